"""The reward curve draws what a run measured: reward, held-out accuracy from the base on, and, for agent
runs, the share of sampled episodes that call a tool."""

import matplotlib

matplotlib.use("Agg")

from matplotlib import pyplot as plt  # noqa: E402

from rlpipe.tracking import plots  # noqa: E402


def _lines(monkeypatch, history, base=None):
    seen = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: seen.setdefault("fig", fig) and path)
    plots.reward_curve(history, "unused.png", "t", base_accuracy=base)
    fig = seen["fig"]
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()}
    plt.close(fig)
    return lines


def test_an_agent_run_plots_its_tool_use(monkeypatch):
    history = [{"iteration": 0, "reward_mean": 0.1, "episode/tool_use_share": 0.3},
               {"iteration": 1, "reward_mean": 0.4, "episode/tool_use_share": 0.8, "heldout_accuracy": 0.5}]
    lines = _lines(monkeypatch, history, base=0.0)
    assert lines["training reward (sampled)"] == ([0, 1], [0.1, 0.4])
    assert lines["held-out accuracy (greedy)"] == ([-1, 1], [0.0, 0.5])
    assert lines["episodes that call a tool (sampled)"] == ([0, 1], [0.3, 0.8])


def test_a_single_turn_run_has_no_tool_line(monkeypatch):
    lines = _lines(monkeypatch, [{"iteration": 0, "reward_mean": 0.2}])
    assert set(lines) == {"training reward (sampled)"}
