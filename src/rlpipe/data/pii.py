"""Personal data and secrets in training text: find them, mask them for reports, redact them.

:func:`find_pii` returns each :class:`PiiFinding` (kind, start, end, the matched text); :func:`redact` puts a
typed placeholder (``[EMAIL]``, ``[AWS_ACCESS_KEY]``) in place of each. Kinds: :data:`KINDS`.

This runs on math and code training data, so a false alarm is the main risk. Every rule is a regular
expression *and* a check that the text really is what the kind says:

- numbers: a checksum where the kind has one (IBAN mod-97, card Luhn), the issuing rules where it has none
  (SSN areas 000/666/9xx, group 00 and serial 0000 are never issued; NINO prefixes), separators that must be
  consistent, and no number that is an operand (``= 415-555-0132``, ``4111111111111111 * 2``): bare digit
  runs without separators are never a phone number or an SSN;
- addresses: every IPv4 octet 0-255 without leading zeros, not part of a longer dotted run (``1.2.3.4.5``),
  not after ``version``/``section``; IPv6 validated by :mod:`ipaddress`, not a slice (``a[1::2]``);
  loopback, unspecified, multicast, reserved, IPv4 link-local and documentation addresses (``127.0.0.1``,
  ``::1``, ``0.0.0.0``, ``255.255.255.0``, ``169.254.169.254``, ``192.0.2.1``, ``2001:db8::1``) name no host and
  are skipped;
  e-mail domains end in a two-letter or a common generic top-level domain (``a@b.transpose(`` is code);
- credentials: the provider's exact format (length, alphabet, the ``T3BlbkFJ`` marker of OpenAI keys, the
  ``AA`` end of Anthropic keys), a minimum Shannon entropy (``AKIAXXXXXXXXXXXXXXXX`` is a placeholder),
  documented examples (``...EXAMPLE``) skipped; a JWT's header and claims must decode to JSON objects; a PEM
  block needs 64 base64 characters of body; ``password = ...`` assignments need a literal value of 8+
  characters that is not code (``input()``, ``os.environ[...]``, ``args.password``, ``${VAR}``) nor a
  placeholder (``changeme``, ``<your key>``, ``xxxx``).

Not detected: names, postal addresses and other personal data in free text (that needs a named-entity
model), phone numbers written as bare digit runs, keys of providers not listed, secrets split across fields.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["KINDS", "PiiFinding", "find_pii", "mask", "redact"]

Span = tuple[int, int]


@dataclass(frozen=True)
class PiiFinding:
    kind: str  # one of KINDS
    start: int
    end: int
    text: str  # the matched text (the value alone for a `password = ...` assignment)

    @property
    def placeholder(self) -> str:
        return f"[{self.kind.upper()}]"

    def masked(self) -> str:
        return mask(self.text)

    def to_dict(self) -> dict[str, object]:
        """For reports: the text masked, never in full."""
        return {"kind": self.kind, "start": self.start, "end": self.end, "masked": self.masked()}


def mask(text: str) -> str:
    """All but the first few characters hidden: ``AKIA…(20 chars)``, ``jo…(16 chars)``."""
    keep = 4 if len(text) >= 16 else 2 if len(text) >= 8 else 1
    return f"{text[:keep]}…({len(text)} chars)"


def entropy(s: str) -> float:
    """Shannon entropy in bits per character (placeholders like ``xxxx`` score near 0)."""
    if not s:
        return 0.0
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


# -- context: is this number an operand? -------------------------------------------------------

_OPERATORS = set("=+*/×÷^<>%")


def _operand(text: str, start: int, end: int) -> bool:
    """A number next to an arithmetic operator or ``=`` (``12+34=46``, ``= 415-555-0132``) is maths."""
    before = text[max(0, start - 3) : start].rstrip()
    after = text[end : end + 3].lstrip()
    if before and (before[-1] in _OPERATORS or before.endswith(" -") or before == "-"):
        return True
    return bool(after) and (after[0] in _OPERATORS or (after[0] == "-" and after[1:2] in (" ", "")))


def _digits(s: str) -> str:
    return "".join(c for c in s if c.isdigit())


# -- e-mail ------------------------------------------------------------------------------------

_EMAIL = re.compile(
    r"(?<![\w.%+-])([A-Za-z0-9][A-Za-z0-9._%+-]{0,63})@"
    r"((?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+([A-Za-z]{2,24}|xn--[A-Za-z0-9-]{2,59}))"
    r"(?![\w(-]|\.[A-Za-z0-9])"
)
# Generic top-level domains common enough to list; any two-letter (country) domain and IDN (xn--) pass too.
_GTLDS = frozenset(
    "com org net edu gov mil int info biz name pro mobi aero coop museum app dev io ai cloud site online tech "
    "xyz email store blog club live top shop work page web space world today news media group team studio "
    "digital solutions company systems network services agency design academy".split()
)


# Addresses that belong to no person: RFC 2606's documentation domains, and service mailboxes
# (git@github.com:owner/repo.git fills code data).
_NOBODY_DOMAINS = frozenset({"example.com", "example.org", "example.net"})
_NOBODY_LOCALS = frozenset({"git", "noreply", "no-reply", "donotreply", "do-not-reply", "mailer-daemon", "postmaster"})


def _emails(text: str) -> Iterator[Span]:
    for m in _EMAIL.finditer(text):
        local, domain, tld = m.group(1), m.group(2).lower(), m.group(3).lower()
        if ".." in local or local.endswith("."):
            continue
        if local.lower() in _NOBODY_LOCALS or domain in _NOBODY_DOMAINS or domain.endswith(tuple("." + d for d in _NOBODY_DOMAINS)):
            continue
        if len(tld) == 2 or tld in _GTLDS or tld.startswith("xn--"):
            yield m.start(), m.end()


# -- phone numbers -----------------------------------------------------------------------------

# Groups need a separator, or a bare E.164 run of 10-14 digits (shorter signed numbers, `+15000000`, are amounts);
# optional separators would let a long digit run split every way.
_PHONE_INTL = re.compile(
    r"\+(?:[1-9]\d{9,13}|[1-9]\d{0,2}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]\d{1,12}){1,6})(?![\w]|[.,-]\d| \d)")
_PHONE_US = re.compile(
    r"(?<![\w.+/-])(?:1[ .-])?(?:\([2-9]\d{2}\)[ .-]?|[2-9]\d{2}(?P<sep>[.-]))[2-9]\d{2}"
    r"(?(sep)(?P=sep)|[ .-])\d{4}(?![\w]|[.,/-]\d| \d)"
)
# A national number with a trunk 0 (UK 020 7123 4567, DE 030 1234567 / 089/12345678, JP 090-1234-5678).
_PHONE_TRUNK = re.compile(r"(?<![\w.+/-])(?<!\d )(?:\(0\d{1,4}\) ?|0\d{1,4}[ /-])\d{3,8}(?:[ -]\d{3,8}){0,2}(?![\w]|[.,/-]\d| \d)")


def _binary_plus(text: str, at: int) -> bool:
    """``5 +44 ...``, ``x+1 ...``: the ``+`` adds; ``call +44 ...``: it starts a phone number."""
    if at > 0 and (text[at - 1].isalnum() or text[at - 1] in ")]_"):
        return True
    before = text[:at].rstrip()
    return bool(before) and (before[-1].isdigit() or before[-1] in ")]" or before[-1] in _OPERATORS)


def _phones(text: str) -> Iterator[Span]:
    for m in _PHONE_INTL.finditer(text):
        if 8 <= len(_digits(m.group())) <= 15 and not _binary_plus(text, m.start()) and not _operand(text, m.start(), m.end()):
            yield m.start(), m.end()
    for rx, low, high in ((_PHONE_US, 10, 11), (_PHONE_TRUNK, 9, 12)):
        for m in rx.finditer(text):
            if low <= len(_digits(m.group())) <= high and not _operand(text, m.start(), m.end()):
                yield m.start(), m.end()


# -- national identifiers ----------------------------------------------------------------------

_SSN = re.compile(r"(?<![\w.+/-])(\d{3})([- ])(\d{2})\2(\d{4})(?![\w]|[.,/-]\d)")
_SSN_VOID = {"123456789", "078051120", "219099999"}  # samples printed on cards and in ads; never valid


def _ssns(text: str) -> Iterator[Span]:
    """US SSN with separators (a bare 9-digit number is far more often just a number)."""
    for m in _SSN.finditer(text):
        area, group, serial = m.group(1), m.group(3), m.group(4)
        if area in ("000", "666") or area[0] == "9" or group == "00" or serial == "0000":
            continue
        digits = area + group + serial
        if digits in _SSN_VOID or len(set(digits)) == 1 or _operand(text, m.start(), m.end()):
            continue
        yield m.start(), m.end()


# UK National Insurance number: no D F I Q U V first, no D F I O Q U V second, suffix A-D, and the prefixes
# BG GB KN NK NT TN ZZ never issued (HMRC NIM39110).
_NINO = re.compile(r"(?<![\w])([A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]) ?\d{2} ?\d{2} ?\d{2} ?[A-D](?!\w)", re.I)
_NINO_VOID = {"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"}


def _ninos(text: str) -> Iterator[Span]:
    for m in _NINO.finditer(text):
        if m.group(1).upper() not in _NINO_VOID:
            yield m.start(), m.end()


# IBAN length per country (SWIFT IBAN registry).
_IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BI": 27, "BR": 29,
    "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DJ": 27, "DK": 18, "DO": 28, "EE": 20, "EG": 29,
    "ES": 24, "FI": 18, "FK": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28,
    "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28,
    "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "LY": 25, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MN": 20,
    "MR": 27, "MT": 31, "MU": 30, "NI": 28, "NL": 18, "NO": 15, "OM": 23, "PK": 24, "PL": 28, "PS": 29, "PT": 25,
    "QA": 29, "RO": 24, "RS": 22, "RU": 33, "SA": 24, "SC": 31, "SD": 18, "SE": 24, "SI": 19, "SK": 24, "SM": 27,
    "SO": 23, "ST": 25, "SV": 28, "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20, "YE": 30,
}
_IBAN_START = re.compile(r"(?<![A-Za-z0-9])([A-Z]{2})(\d{2})")


def _iban_ok(compact: str) -> bool:
    """ISO 13616 check: the country and check digits moved to the end, letters as 10..35, mod 97 == 1."""
    moved = compact[4:] + compact[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _ibans(text: str) -> Iterator[Span]:
    """Compact or in groups of four (one space between groups), exactly the country's length."""
    for m in _IBAN_START.finditer(text):
        want = _IBAN_LENGTHS.get(m.group(1))
        if want is None:
            continue
        chars, j = m.group(1) + m.group(2), m.end()
        while len(chars) < want and j < len(text):
            c = text[j]
            if c.isascii() and (c.isdigit() or c.isupper()):
                chars, j = chars + c, j + 1
            elif c == " " and len(chars) % 4 == 0 and text[j + 1 : j + 2].isalnum():
                j += 1
            else:
                break
        if len(chars) == want and not text[j : j + 1].isalnum() and _iban_ok(chars):
            yield m.start(), j


# -- payment cards -----------------------------------------------------------------------------

_CARD = re.compile(r"(?<![\w.,+/-])\d(?:[ -]?\d){12,18}(?![\w]|[.,/-]\d)")
_CARD_GROUPS = {(4, 4, 4, 4), (4, 6, 5), (4, 6, 4), (4, 4, 4, 4, 3), (4, 4, 4, 3), (4, 4, 4, 1), (4, 4, 5)}


def luhn(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = int(c) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


# Issuer prefixes (IIN) and the lengths each issues: (first digits, lowest, highest). Visa 4; Mastercard 51-55 and
# 2221-2720; Amex 34/37; Diners 300-305/36/38/39; Discover 6011/644-649/65; JCB 3528-3589; UnionPay 62; Maestro
# 50/56-69 (Dankort 5019 among them); UATP 1 (15 digits).
_IIN = [(("4",), 13, 19), (tuple(map(str, range(51, 56))) + tuple(map(str, range(2221, 2721))), 16, 16),
        (("34", "37"), 15, 15), (("300", "301", "302", "303", "304", "305", "36", "38", "39"), 14, 19),
        (("6011", "644", "645", "646", "647", "648", "649", "65"), 16, 19), (tuple(map(str, range(3528, 3590))), 16, 19),
        (("62",), 16, 19), (("50", "56", "57", "58", "59", "6"), 12, 19), (("1",), 15, 15)]


def _issued(digits: str) -> bool:
    return any(digits.startswith(prefixes) and low <= len(digits) <= high for prefixes, low, high in _IIN)


def _card_ok(s: str) -> bool:
    seps = {c for c in s if not c.isdigit()}
    digits = _digits(s)
    if len(seps) > 1 or not 13 <= len(digits) <= 19 or len(set(digits)) == 1 or not _issued(digits):
        return False
    if seps and tuple(len(g) for g in re.split(r"[ -]", s)) not in _CARD_GROUPS:
        return False
    return luhn(digits)


def _cards(text: str) -> Iterator[Span]:
    """Luhn-checked 13-19 digits, bare or in the usual groups; a trailing group (a CVV) may follow."""
    for m in _CARD.finditer(text):
        s = m.group()
        while s and not _card_ok(s):
            cut = max(s.rfind(" "), s.rfind("-"))
            s = s[:cut] if cut > 0 else ""
        if s and not _operand(text, m.start(), m.start() + len(s)):
            yield m.start(), m.start() + len(s)


# -- IP addresses ------------------------------------------------------------------------------

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)")
_NOT_IP_WORDS = re.compile(
    r"(?<![\w])(?:version|ver|v|release|build|section|sec|chapter|figure|fig|table|eq|equation|theorem|lemma|step|"
    r"rule|item|oid|isbn|no|§)s?\.?\s*[\"'(\[]?$", re.I)
_IPV6 = re.compile(
    r"(?<![\w:.\[])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?:%[\w.]+)?(?![\w:]|\.\d)"
    r"|(?<=\[)(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?=\])"
)


# Documentation ranges (RFC 5737, RFC 3849) and "this network" 0/8: the example.com of addresses.
_NOBODY_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "0.0.0.0/8",
                                                   "2001:db8::/32")]


def _boring(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Addresses that name no host out there: loopback, 0.0.0.0 / ::, multicast, documentation ranges; for IPv4
    also the reserved block (netmasks such as 255.255.255.0, broadcast) and link-local (169.254.169.254, the cloud
    metadata endpoint in every SDK). IPv6's "reserved" blocks hold real addresses (IPv4-mapped ones) and stay in."""
    v4_only = addr.version == 4 and (addr.is_reserved or addr.is_link_local)
    if addr.is_loopback or addr.is_unspecified or addr.is_multicast or v4_only:
        return True
    mapped = getattr(addr, "ipv4_mapped", None)
    return any(a in n for a in (addr, mapped) if a is not None for n in _NOBODY_NETS if a.version == n.version)


_PREFIX_LEN = re.compile(r"/(\d{1,3})(?!\d)")


def _network(text: str, end: int, address: str) -> bool:
    """``10.0.0.0/8``, ``2001:10::/28``: a network in CIDR notation (host bits zero) names no host."""
    m = _PREFIX_LEN.match(text, end)
    if not m:
        return False
    try:
        ipaddress.ip_network(f"{address}/{m.group(1)}", strict=True)
    except ValueError:
        return False
    return True


def _ipv4s(text: str) -> Iterator[Span]:
    for m in _IPV4.finditer(text):
        if _NOT_IP_WORDS.search(text[max(0, m.start() - 12) : m.start()]) or _network(text, m.end(), m.group()):
            continue
        if not _boring(ipaddress.IPv4Address(m.group())):
            yield m.start(), m.end()


def _ipv6s(text: str) -> Iterator[Span]:
    for m in _IPV6.finditer(text):
        s = m.group()
        if m.start() > 0 and text[m.start() - 1] == "[" and m.start() > 1 and (text[m.start() - 2].isalnum() or text[m.start() - 2] in "_)]"):
            continue  # a[1::2]: a slice, not an address
        groups = [g for g in s.split("%")[0].replace("::", ":").split(":") if g]
        if "::" in s and not ("." in s or (len(groups) >= 2 and any(len(g) >= 2 for g in groups))):
            continue  # 1::2, ::5 — slices and ratios far more often than addresses
        if not any(c.isdigit() for c in s):
            continue  # cafe::feed, dead:beef:... — code paths and words spelled in hex
        try:
            addr = ipaddress.IPv6Address(s.split("%")[0])
        except ValueError:
            continue
        if not _boring(addr) and not _network(text, m.end(), s):
            yield m.start(), m.end()


# -- credentials -------------------------------------------------------------------------------


def _tokens(rx: re.Pattern[str], min_entropy: float, group: int = 0) -> Callable[[str], Iterator[Span]]:
    """Matches of a provider's exact format whose entropy is a random key's, not a placeholder's."""
    def find(text: str) -> Iterator[Span]:
        for m in rx.finditer(text):
            s = m.group(group)
            if entropy(s) >= min_entropy and "EXAMPLE" not in s:
                yield m.start(group), m.end(group)
    return find


_AWS_KEY_ID = re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z2-7]{16}(?![A-Za-z0-9])")
_AWS_SECRET = re.compile(
    r"(?i)(?<![\w])aws[\w.-]{0,30}?(?:secret|key)[\w.-]{0,20}[\"']?[ \t]*(?:=|:=|:|=>)[ \t]*[\"']?"
    r"([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])")
_GITHUB = re.compile(r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{82})(?![A-Za-z0-9_])")
_SLACK = re.compile(
    r"(?<![\w-])(?:xox[abposer]-(?:\d-)?\d{6,13}(?:-\d{6,13}){0,3}-[A-Za-z0-9]{10,64}(?![\w-])"
    r"|https://hooks\.slack\.com/(?:services|workflows)/T[A-Z0-9]{8,12}/B[A-Z0-9]{8,12}/[A-Za-z0-9]{24})")
_OPENAI = re.compile(
    r"(?<![\w-])sk-(?:(?:proj|svcacct|admin)-[A-Za-z0-9_-]{20,200}|[A-Za-z0-9]{20})T3BlbkFJ[A-Za-z0-9_-]{20,200}(?![\w-])")
_ANTHROPIC = re.compile(r"(?<![\w-])sk-ant-(?:api|admin)\d{2}-[A-Za-z0-9_-]{93}AA(?![\w-])")
_GOOGLE = re.compile(r"(?<![\w-])AIza[0-9A-Za-z_-]{35}(?![\w-])")
_HUGGINGFACE = re.compile(r"(?<![\w-])hf_[A-Za-z]{34}(?![\w-])")


def _slack(text: str) -> Iterator[Span]:
    for m in _SLACK.finditer(text):
        tail = m.group().rsplit("-", 1)[-1].rsplit("/", 1)[-1]
        if any(c.isdigit() for c in tail) and any(c.isalpha() for c in tail) and entropy(tail) >= 2.5:
            yield m.start(), m.end()


_JWT = re.compile(r"(?<![\w-])(eyJ[A-Za-z0-9_-]{5,})\.(eyJ[A-Za-z0-9_-]{5,})(?:\.[A-Za-z0-9_-]*)?(?![\w-])")


def _json_object(part: str) -> bool:
    try:
        value = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return False
    return isinstance(value, dict) and bool(value)


def _jwts(text: str) -> Iterator[Span]:
    for m in _JWT.finditer(text):
        if _json_object(m.group(1)) and _json_object(m.group(2)):
            yield m.start(), m.end()


_PEM_BEGIN = re.compile(r"-----BEGIN ((?:[A-Z0-9]+ )*)PRIVATE KEY( BLOCK)?-----")
_PEM_BODY = re.compile(r"(?:(?:\r?\n|\\n)[A-Za-z0-9+/=]{16,})+")  # base64 lines, when the block has no END line
_BASE64 = re.compile(r"[A-Za-z0-9+/=]")


def _pem_keys(text: str) -> Iterator[Span]:
    """The whole block, BEGIN to END (or to the last base64 line of a block cut short)."""
    for m in _PEM_BEGIN.finditer(text):
        end_line = f"-----END {m.group(1)}PRIVATE KEY{m.group(2) or ''}-----"
        stop = text.find(end_line, m.end(), m.end() + 20000)
        if stop >= 0:
            body, end = text[m.end() : stop], stop + len(end_line)
        else:
            tail = _PEM_BODY.match(text, m.end())
            body, end = (tail.group(), tail.end()) if tail else ("", m.end())
        if len(_BASE64.findall(body.replace("\\n", "\n"))) >= 64:
            yield m.start(), end


# `password = ...`, `api_key: ...`: the value alone is the finding. `pass`/`pwd` only as a whole name part.
_ASSIGN = re.compile(
    r"(?i)(?<![\w])(?:[\w.-]{0,40}?(?:password|passwd|passphrase|secret|api[_-]?key|apikey|api[_-]?token"
    r"|access[_-]?token|auth[_-]?token|refresh[_-]?token|bearer[_-]?token|session[_-]?token|bot[_-]?token"
    r"|private[_-]?key|secret[_-]?key|access[_-]?key|credentials?)|(?:[\w.-]{0,40}?[_.-])?(?:pass|pwd))(?![\w])"
    r"(?:\\?[\"'])?[ \t]*(?:==|!=|:=|=>|=|:)[ \t]*@?"  # \\" too: JSON text (tests, chat prompts)
    r"(?:\\?\"(?P<dq>[^\"\s\\]{1,200})\\?\"|'(?P<sq>[^'\s\\]{1,200})'|`(?P<bq>[^`\s]{1,200})`"
    r"|(?P<bare>[^\s\"'`,;(){}\[\]<>]{1,200})(?![(\[]))"
)
_PLACEHOLDER = re.compile(
    r"example|xxxx|changeme|change_me|your[_-]|yourpass|\$\{|\{\{|%\(|fake|dummy|placeholder|redacted|\*\*\*|"
    r"\.\.\.|…|<|>|^\$|^env[:(]|^none$|^null$|^true$|^false$", re.I)
_CODE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$|^[A-Za-z_][A-Za-z0-9]*_\w*$|^[A-Za-z_]+$")


# Values every tutorial and test suite uses ("password123", "admin1234", "12345678"): trivial, not a secret.
_TRIVIAL = re.compile(r"^(?:password|passwd|pass|secret|admin|test|qwerty|letmein|changeit|default|root|user|guest|"
                      r"abc|foobar|welcome|login|[0-9])*[0-9!@#$%^&*._-]*$", re.I)


def _credible(value: str, bare: bool) -> bool:
    """A literal that looks like a real credential: 8+ characters, some letters and some variety, not a
    placeholder nor a trivial value, and (unquoted) not code: ``args.password``, ``user_password``."""
    if len(value) < 8 or _PLACEHOLDER.search(value) or entropy(value) < 2.5 or _TRIVIAL.match(value):
        return False
    if not any(c.isalnum() for c in value):
        return False
    return not (bare and _CODE.match(value))


def _assignments(text: str) -> Iterator[Span]:
    for m in _ASSIGN.finditer(text):
        for name in ("dq", "sq", "bq", "bare"):
            if m.group(name) is not None:
                # an unquoted value cut short by backtracking is the head of a call (`Hunter2Secret(x)`)
                cut = name == "bare" and text[m.end(name) : m.end(name) + 1] not in ("", *" \t\r\n\"'`,;)}]>")
                if not cut and _credible(m.group(name), name == "bare"):
                    yield m.start(name), m.end(name)
                break


# -- the detectors, most specific first: an earlier kind wins an overlap ---------------------------

_DETECTORS: list[tuple[str, Callable[[str], Iterator[Span]]]] = [
    ("private_key", _pem_keys),
    ("jwt", _jwts),
    ("aws_access_key", _tokens(_AWS_KEY_ID, 3.0)),
    ("aws_secret_key", _tokens(_AWS_SECRET, 3.5, group=1)),
    ("github_token", _tokens(_GITHUB, 3.0)),
    ("slack_token", _slack),
    ("openai_key", _tokens(_OPENAI, 3.5)),
    ("anthropic_key", _tokens(_ANTHROPIC, 3.5)),
    ("google_api_key", _tokens(_GOOGLE, 3.5)),
    ("huggingface_token", _tokens(_HUGGINGFACE, 3.0)),
    ("secret", _assignments),
    ("email", _emails),
    ("iban", _ibans),
    ("credit_card", _cards),
    ("us_ssn", _ssns),
    ("uk_nino", _ninos),
    ("ip_address", _ipv6s),  # before IPv4: ::ffff:192.0.2.1 is one address
    ("ip_address", _ipv4s),
    ("phone", _phones),
]
KINDS: tuple[str, ...] = tuple(dict.fromkeys(kind for kind, _ in _DETECTORS))


def find_pii(text: str, kinds: set[str] | None = None) -> list[PiiFinding]:
    """Every finding in ``text``, by position; of two overlapping findings the more specific kind (earlier in
    :data:`KINDS`) wins, then the longer."""
    taken: list[Span] = []
    found: list[PiiFinding] = []
    for kind, detect in _DETECTORS:
        if kinds is not None and kind not in kinds:
            continue
        for start, end in sorted(detect(text), key=lambda s: (s[0], -s[1])):
            if any(start < e and s < end for s, e in taken):
                continue
            taken.append((start, end))
            found.append(PiiFinding(kind, start, end, text[start:end]))
    return sorted(found, key=lambda f: f.start)


def redact(text: str, kinds: set[str] | None = None) -> str:
    """``text`` with each finding replaced by its placeholder (``[EMAIL]``, ``[SECRET]``, ...)."""
    out, at = [], 0
    for f in find_pii(text, kinds):
        out += [text[at : f.start], f.placeholder]
        at = f.end
    return "".join(out) + text[at:]
