"""The iteration flow runs' settings: no heartbeat, derived once per settings context (not per iteration)."""

from prefect.context import get_settings_context
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from flows.train import _no_heartbeat


def test_no_heartbeat_inside_and_the_outer_settings_untouched():
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        outer = get_settings_context().settings
        with _no_heartbeat():
            assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None
            first = get_settings_context().settings
        assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() == 30 and get_settings_context().settings is outer
        with _no_heartbeat():
            assert get_settings_context().settings is first  # reused: not revalidated per iteration
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 60}):
        with _no_heartbeat():  # other outer settings: derived from them
            current = get_settings_context().settings
            assert current is not first and PREFECT_FLOWS_HEARTBEAT_FREQUENCY.value() is None
