# tests for bench/report.py (the statistics and the plot of bench/compare.sh) on hand-made
# numbers. CPU, a second.

import json
import math
import os
import sys

import numpy as np
import pytest

from bench import report
from bench.report import load, paired_ci, plot, summarize, t975

# a fake comparison, 3 seeds: test greedy accuracy, pass@1 and pass@8 of each arm, chosen so
# that the paired differences are exact in binary floating point (multiples of 1/8 and 1/16)
ACC = {"1": {"sft": 0.25, "sft_more": 0.375, "rft": 0.25, "grpo": 0.5},
       "2": {"sft": 0.125, "sft_more": 0.25, "rft": 0.25, "grpo": 0.5},
       "3": {"sft": 0.25, "sft_more": 0.25, "rft": 0.375, "grpo": 0.625}}


def write_rows(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def fake_tree(root, acc=ACC, split="test"):
    """out/compare as bench/compare.sh leaves it: each seed's <split>_<arm> evaluation (a
    stale row first, the last row counts) and each trained arm's run with validation
    evaluations against wall-clock seconds."""
    for seed, arms in acc.items():
        d = os.path.join(root, f"seed{seed}")
        for arm, a in arms.items():
            write_rows(os.path.join(d, f"{split}_{arm}", "metrics.jsonl"),
                       [{"iter": 0, "eval/accuracy": 0.0},
                        {"iter": 0, "eval/accuracy": a, "eval/pass@1": a / 2,
                         "eval/pass@8": 1 - a}])
        for k, arm in enumerate(report.CURVE_ARMS):
            rows = [{"iter": 10 * i, "eval/accuracy": 0.1 + 0.05 * i + 0.01 * k,
                     "perf/elapsed_s": 5.0 + 30 * i} for i in range(5)]
            # a training row: not a point
            rows.insert(1, {"iter": 5, "train/loss": 1.0, "perf/elapsed_s": 12.0})
            write_rows(os.path.join(d, arm, "metrics.jsonl"), rows)


def test_t975_table():
    assert t975(1) == 12.706 and t975(2) == 4.303 and t975(4) == 2.776 and t975(30) == 2.042
    assert t975(100) == 2.042  # past the table: its last value, a little wide
    with pytest.raises(ValueError, match="df=0"):
        t975(0)


def test_paired_ci_hand_made():
    mean, lo, hi = paired_ci([3, 4, 5], [2, 2, 2])  # differences 1, 2, 3: std 1 (ddof=1), n = 3
    half = 4.303 * 1 / math.sqrt(3)
    assert mean == 2
    assert lo == pytest.approx(2 - half) and hi == pytest.approx(2 + half)
    assert half == pytest.approx(2.484, abs=1e-3)


def test_paired_ci_is_paired_not_two_sample():
    # the arms' own spreads are large, their per-seed difference is constant:
    # a zero-width interval
    mean, lo, hi = paired_ci([0.5, 0.75, 1.0, 0.25], [0.25, 0.5, 0.75, 0.0])
    assert (mean, lo, hi) == (0.25, 0.25, 0.25)


def test_paired_ci_one_seed_and_bad_input():
    mean, lo, hi = paired_ci([0.5], [0.25])
    assert mean == 0.25 and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError, match="one length"):
        paired_ci([1, 2], [1])
    with pytest.raises(ValueError, match="non-empty"):
        paired_ci([], [])


def test_std_is_ddof_1():
    assert report.std([1, 2, 3, 4]) == pytest.approx(math.sqrt(5 / 3))  # ddof=0 would be sqrt(5/4)
    assert report.std([0.5]) is None


def test_load_and_summarize_fake_tree(tmp_path):
    fake_tree(str(tmp_path))
    results = summarize(load(str(tmp_path), [1, 2, 3]))
    assert list(results) == ["split", "arms", "per_seed", "pass@1", "pass@8", "summary",
                             "paired", "paired_pass"]
    assert results["arms"] == ["sft", "sft_more", "rft", "grpo"]   # no heuristic, sft_all: left out
    assert results["per_seed"] == ACC  # the last row of each evaluation, seeds as strings
    assert results["pass@1"]["2"]["grpo"] == 0.25 and results["pass@8"]["3"]["sft"] == 0.75
    grpo = [ACC[s]["grpo"] for s in "123"]
    assert results["summary"]["grpo"] == {"mean": pytest.approx(np.mean(grpo)),
                                          "std": pytest.approx(0.0721687836)}
    assert set(results["summary"]) == set(results["arms"])
    assert list(results["paired"]) == ["grpo-sft", "grpo-sft_more", "grpo-rft", "sft_more-sft",
                                       "rft-sft"]
    p = results["paired"]["grpo-sft"]  # differences 0.25, 0.375, 0.375
    half = 4.303 * np.std([0.25, 0.375, 0.375], ddof=1) / math.sqrt(3)
    assert p["n"] == 3 and p["mean"] == pytest.approx(1 / 3)
    assert p["ci95"] == pytest.approx([1 / 3 - half, 1 / 3 + half])
    # pass@8 is 1 - accuracy in fake_tree: its differences are the greedy ones negated
    p8 = results["paired_pass"]["pass@8"]["grpo-sft"]
    assert p8["mean"] == pytest.approx(-1 / 3)
    assert p8["ci95"] == pytest.approx([-1 / 3 - half, -1 / 3 + half])
    # differences 0.25, 0.25, 0.25
    assert results["paired"]["grpo-rft"]["mean"] == pytest.approx(0.25)
    assert results["paired"]["grpo-rft"]["ci95"] == pytest.approx([0.25, 0.25])


def test_one_seed_leaves_spread_undefined(tmp_path):
    fake_tree(str(tmp_path), {"7": ACC["1"]})
    results = summarize(load(str(tmp_path), ["7"]))
    assert results["summary"]["sft"] == {"mean": 0.25, "std": None}
    assert results["paired"]["grpo-sft"] == {"mean": 0.25, "ci95": None, "n": 1,
                                             "bootstrap95": None}
    text = report.tables(results)
    assert "| grpo | 0.500 ± n/a (0.500) |" in text
    assert "| grpo - sft | +0.250 | n/a | n/a | n/a | n/a |" in text


def test_missing_evaluation_names_its_file(tmp_path):
    fake_tree(str(tmp_path))
    os.remove(tmp_path / "seed2" / "test_rft" / "metrics.jsonl")
    with pytest.raises(FileNotFoundError, match="seed2/test_rft/metrics.jsonl"):
        load(str(tmp_path), [1, 2, 3])


def test_main_writes_results_json_and_tables(tmp_path, capsys, monkeypatch):
    fake_tree(str(tmp_path))
    # as if not installed: said, and no plot, no crash
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report.main([str(tmp_path)]) == 0  # no seeds given: every seed<S> directory
    with open(tmp_path / "results.json") as f:
        written = json.load(f)
    assert written == json.loads(json.dumps(summarize(load(str(tmp_path), ["1", "2", "3"]))))
    out = capsys.readouterr().out
    assert "| arm | greedy accuracy | pass@1 | pass@8 |" in out
    assert "| grpo | 0.542 ± 0.072 (0.500, 0.500, 0.625) |" in out
    assert "| grpo - rft | +0.250 | [+0.250, +0.250] | yes, above 0 |" in out
    assert "| sft_more - sft | +0.083 |" in out and "| no |" in out
    assert "matplotlib is not installed" in out and not (tmp_path / "val_accuracy.png").exists()


def test_main_reads_the_confirmatory_split_apart_from_the_test_split(tmp_path, capsys):
    fake_tree(str(tmp_path))
    flipped = {s: {arm: 1 - a for arm, a in arms.items()} for s, arms in ACC.items()}
    fake_tree(str(tmp_path), flipped, split="confirm")
    assert report.main(["--confirm", str(tmp_path)]) == 0
    with open(tmp_path / "results_confirm.json") as f:
        written = json.load(f)
    assert written["split"] == "confirm" and written["per_seed"] == flipped
    out = capsys.readouterr().out
    assert "confirm split, mean ± std" in out and "paired differences of greedy confirm" in out
    assert not (tmp_path / "results.json").exists()   # the test split's is its own file


def write_outcomes(path, digits_targets, rewards, reach=None):
    rows = [{"digits": list(d), "target": t, "reward": r, "completion": ""}
            for (d, t), r in zip(digits_targets, rewards)]
    for row, x in zip(rows, reach or []):
        row["reach"] = x
    write_rows(path, rows)


def test_by_size_table_and_cluster_bootstrap_on_hand_made_outcomes(tmp_path):
    # 2 seeds, arms heuristic and grpo; 4 problems over 2 digit multisets, a and b,
    # 2 problems each
    problems = [((1, 2, 3), 6), ((1, 2, 3), 5), ((2, 3, 4, 5), 14), ((2, 3, 4, 5), 30)]
    rewards = {"heuristic": [[1, 0, 0, 0], [1, 0, 0, 0]], "grpo": [[1, 1, 1, 0], [1, 1, 0, 1]]}
    for seed in ("1", "2"):
        for arm, per_seed in rewards.items():
            r = per_seed[int(seed) - 1]
            d = tmp_path / f"seed{seed}" / f"test_{arm}"
            write_rows(str(d / "metrics.jsonl"), [{"iter": 0, "eval/accuracy": sum(r) / 4,
                                                   "eval/accuracy_3digits": sum(r[:2]) / 2,
                                                   "eval/accuracy_4digits": sum(r[2:]) / 2}])
            write_outcomes(str(d / "outcomes.jsonl"), problems, r)
    results = summarize(load(str(tmp_path), ["1", "2"]), str(tmp_path))
    assert results["arms"] == ["heuristic", "grpo"]
    assert list(results["paired"]) == ["grpo-heuristic"]
    # per problem, the difference averaged over seeds: 0, 1, 0.5, 0.5; by multiset: a =
    # (0, 1), b = (0.5, 0.5). Resampling the two multisets: the mean is 0.5 whichever is
    # drawn (both clusters average 0.5)
    assert results["paired"]["grpo-heuristic"]["bootstrap95"] == pytest.approx([0.5, 0.5])
    text = report.tables(results)
    assert "| heuristic | 0.500 | 0.000 |" in text and "| grpo | 1.000 | 0.500 |" in text
    assert ("| grpo - heuristic | +0.500 | [+0.500, +0.500] | yes, above 0 | [+0.500, +0.500] "
            "| yes, above 0 |") in text


def test_accuracy_by_reach_band_leaves_empty_bands_out(tmp_path):
    # 2 seeds, 4 problems: two of reach 0.05-0.10, one of 0.10-0.20, one of 0.20 and above
    problems = [((1, 2, 3, 4), 6), ((1, 2, 3, 4), 5), ((2, 3, 4, 5), 14), ((2, 3, 4, 5), 30)]
    reach = [0.06, 0.09, 0.15, 0.3]
    rewards = {"chain_rule": [[1, 0, 0, 1], [1, 0, 0, 1]], "grpo": [[1, 1, 1, 0], [0, 1, 0, 1]]}
    for seed in ("1", "2"):
        for arm, per_seed in rewards.items():
            r = per_seed[int(seed) - 1]
            d = tmp_path / f"seed{seed}" / f"test_{arm}"
            write_rows(str(d / "metrics.jsonl"), [{"iter": 0, "eval/accuracy": sum(r) / 4}])
            write_outcomes(str(d / "outcomes.jsonl"), problems, r, reach)
    results = summarize(load(str(tmp_path), ["1", "2"]), str(tmp_path))
    by_reach = results["accuracy_by_reach"]
    assert by_reach["problems"] == [0, 0, 2, 1, 1]
    # grpo, band 0.05-0.10: (1 + 1 + 0 + 1) / 4 over both seeds; 0.10-0.20: (1 + 0) / 2
    assert by_reach["grpo"][2:] == [0.75, 0.5, 0.5] and by_reach["chain_rule"][2:] == [0.5, 0, 1]
    text = report.tables(results)
    assert ("| arm | reach 0.05-0.10 (2) | reach 0.10-0.20 (1) | reach 0.20-1.00 (1) |" in text
            and "| grpo | 0.750 | 0.500 | 0.500 |" in text and "0.00-0.02" not in text)


def test_cluster_bootstrap_resamples_whole_clusters():
    # two clusters, a: 10 problems of difference 1, b: 2 of difference 0. Drawing 2
    # clusters gives (a, a) -> 1, (a, b) -> 10/12, (b, b) -> 0, each a quarter of the time
    # but the middle one: the interval is [0, 1] (resampling problems instead would put it
    # near [0.6, 1])
    lo, hi = report.cluster_bootstrap([1.0] * 10 + [0.0] * 2, ["a"] * 10 + ["b"] * 2)
    assert (lo, hi) == (0.0, 1.0)
    assert report.cluster_bootstrap([0.25] * 6, list("abcabc")) == pytest.approx((0.25, 0.25))


def test_plot_run_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_rows(str(tmp_path / "grpo" / "metrics.jsonl"),
               [{"iter": 0, "eval/accuracy": 0.1}, {"iter": 1, "rollout/completion_len": 30.0},
                {"iter": 2, "rollout/completion_len": 25.0, "eval/accuracy": 0.2}])
    path = report.plot_run(str(tmp_path / "grpo"), str(tmp_path / "grpo.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_run_draws_the_start_and_the_better_rule(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = [{"iter": 0, "eval/accuracy": 0.25}, {"iter": 10, "rollout/reward_mean": 0.4},
            {"iter": 20, "eval/accuracy": 0.5}]
    write_rows(str(tmp_path / "grpo" / "metrics.jsonl"), rows)
    for rule, acc in (("heuristic", 0.25), ("chain_rule", 0.3125)):
        write_rows(str(tmp_path / f"val_{rule}" / "metrics.jsonl"),
                   [{"iter": 0, "eval/accuracy": acc}])
    dirs = [str(tmp_path / "val_heuristic"), str(tmp_path / "val_chain_rule")]
    fig, ax = plt.subplots()
    report.draw_references(ax, rows, [rows[0], rows[2]], dirs)
    labels = ax.get_legend_handles_labels()[1]
    plt.close(fig)
    assert labels == ["rollouts' mean reward (sampled, training problems)", "SFT start 0.250",
                      "best rule (chain_rule) 0.312"]
    path = report.plot_run(str(tmp_path / "grpo"), str(tmp_path / "grpo.png"), dirs)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_mean_curve_on_the_common_range():
    grid, mean = report.mean_curve([([0, 10], [0.0, 1.0]), ([2, 20], [0.2, 0.2]), ([], [])],
                                   points=3)
    assert list(grid) == [2, 6, 10]
    assert mean == pytest.approx([(0.2 + 0.2) / 2, (0.6 + 0.2) / 2, (1.0 + 0.2) / 2])
    assert report.mean_curve([([5], [0.3])]) is None


def test_flops_curve_places_evaluations_on_the_logged_flops(tmp_path):
    # training rows log (iter, FLOPs) every 10 steps; evaluations at 0, 15 and 30 fall
    # before, between and on them: 0 on the line extended back from the first two rows
    # (RFT's sampling spent before step 1)
    path = str(tmp_path / "rft" / "metrics.jsonl")
    write_rows(path, [{"iter": 0, "eval/accuracy": 0.1}, {"iter": 10, "perf/flops_total": 5.0},
                      {"iter": 20, "perf/flops_total": 6.0}, {"iter": 15, "eval/accuracy": 0.2},
                      {"iter": 30, "perf/flops_total": 8.0, "eval/accuracy": 0.3}])
    assert report.flops_curve(path) == ([4.0, 5.5, 8.0], [0.1, 0.2, 0.3])
    # no FLOPs logged: no curve rather than a guess
    write_rows(path, [{"iter": 0, "eval/accuracy": 0.1}])
    assert report.flops_curve(path) == ([], [])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    fake_tree(str(tmp_path))
    t, a = report.val_curve(str(tmp_path / "seed1" / "grpo" / "metrics.jsonl"))
    assert t == [5.0, 35.0, 65.0, 95.0, 125.0] and a[0] == pytest.approx(0.1)  # eval rows only
    assert report.flops_curve(str(tmp_path / "seed1" / "missing.jsonl")) == ([], [])
    path = plot(str(tmp_path), ["1", "2", "3"], str(tmp_path / "val_accuracy.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_right_answer():
    from itertools import combinations
    from bench.pass_at_k import curves, pass_at_k
    for n, c in ((6, 0), (6, 1), (6, 3), (7, 7), (8, 2)):
        answers = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(combinations(answers, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))
    # the blind search's curve of a problem is 1 - (1 - reach)^k; an arm's is averaged over
    # problems, then over seeds. Reach 1 (3 and 5 make 15) and 1/9 (3 5 7 -> 22)
    rows = [{"digits": [3, 5], "target": 15, "right": 2, "n": 4},
            {"digits": [3, 5, 7], "target": 22, "right": 0, "n": 4}]
    table = curves({"grpo": [rows, [dict(r, right=4) for r in rows]]})
    assert table["all"]["blind search"][:2] == [pytest.approx((1 + 1 / 9) / 2),
                                                pytest.approx((1 + 1 - (8 / 9) ** 2) / 2)]
    assert table["all"]["grpo"][0] == pytest.approx(((0.5 + 0) / 2 + 1) / 2)
    assert table["all"]["k"] == [1, 2, 4]   # up to the samples drawn: 4
    assert table["all"]["grpo"][2] == pytest.approx(((1 + 0) / 2 + 1) / 2)
    # empty bands are left out
    assert list(table) == ["all", "reach 0.10-0.20", "reach 0.20-1.00"]
    assert table["reach 0.20-1.00"]["problems"] == 1 and table["all"]["problems"] == 2
    with pytest.raises(AssertionError, match="other problems"):   # arms must share problems
        curves({"grpo": [rows], "sft": [rows[::-1]]})
