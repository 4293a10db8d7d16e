"""One registry class for everything rlpipe looks up by a name from a config: advantage estimators, policy
losses, KL estimators, preference losses, verifiers and environments.

Registering a name twice is an error (a plugin must not silently replace a built-in); an unknown name is a
``KeyError`` that lists the valid names and says how to add one. A leaf: it imports nothing from rlpipe.

    POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", fix="register one with @register_policy_loss")

    @POLICY_LOSSES.register("gspo")
    def gspo(...): ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(Generic[T]):
    """Name → item. ``kind`` names the items in errors ("verifier"); ``fix`` says how to add a missing one."""

    def __init__(self, kind: str, fix: str = ""):
        self.kind = kind
        self.fix = fix
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers what it decorates under ``name`` and returns it unchanged."""

        def deco(item: T) -> T:
            self.add(name, item)
            return item

        return deco

    def add(self, name: str, item: T) -> T:
        """Register ``item`` under ``name``; a name already taken is a ``ValueError``."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered ({_label(self._items[name])}); "
                             f"give {_label(item)} another name")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        """The item registered under ``name``; an unknown name is a ``KeyError`` listing the valid ones."""
        try:
            return self._items[name]
        except KeyError:
            fix = f"; {self.fix}" if self.fix else ""
            raise KeyError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names()) or 'none'}{fix}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def copy(self) -> "Registry[T]":
        """A registry with the same items, to register into without changing this one (tests)."""
        out: Registry[T] = Registry(self.kind, self.fix)
        out._items = dict(self._items)
        return out

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


def _label(item: object) -> str:
    return getattr(item, "__qualname__", None) or repr(item)
