"""Page 4's record-dependent sentences say what is and is not measured."""

import pytest

from trainplan.runbook import validation_text as vt


def test_hosts_list_names_every_host_largest_first():
    hosts = {"4 x NVIDIA H200": {"configs": 1}, "2 x NVIDIA H200": {"configs": 10}}
    assert vt.hosts_list(hosts) == "4 x NVIDIA H200 (1 configuration) and 2 x NVIDIA H200 (10)"
    assert vt.hosts_list({"2 x X": {"configs": 3}}) == "2 x X (3 configurations)"


def test_not_measured_note_lists_waiting_configs_and_the_missing_slice():
    out = {"predicted_not_measured": ["tp4-mb8-c"], "rows": [{"model": "llama-1.3b"}]}
    note = vt.not_measured_note(out)
    assert "tp4-mb8-c" in note and "layer slice of llama-13b" in note and note.endswith(".")
    out = {"predicted_not_measured": [], "rows": [{"model": "llama-13b:4-layers"}]}
    note = vt.not_measured_note(out)
    assert "tp4" not in note and "layer slice" not in note and "profiler trace" in note
    assert vt.not_measured_note(out, traced=True) == "nothing the page relies on."


def test_worst_repredicted_picks_the_largest_miss_among_the_kept_rows():
    from trainplan.runbook import validation_text as vt

    def row(name, tp, meas, pred):
        return {"config": name, "layout": {"tp": tp}, "measured_step_time_s": meas,
                "repredicted": {"calibrated": {"step_time_s": pred}}}

    rows = [row("a", 2, 1.0, 0.9), row("b", 2, 1.0, 1.2), row("c", 1, 1.0, 0.1),
            {"config": "d", "layout": {"tp": 2}, "measured_step_time_s": 1.0, "repredicted": None}]
    worst = vt.worst_repredicted(rows, lambda r: r["layout"]["tp"] > 1)
    assert worst["config"] == "b" and worst["error"] == pytest.approx(0.2)
    assert worst["direction"] == "predicted slower than it ran"
    faster = vt.worst_repredicted(rows, lambda r: r["config"] == "c")
    assert faster["direction"] == "predicted faster than it ran"
    assert vt.worst_repredicted(rows, lambda r: r["config"] == "d") is None


def test_suspects_name_each_layout_s_least_sure_terms():
    from trainplan.compare.matching import suspects
    base = {"dp": 1, "tp": 1, "pp": 1, "zero": 0, "micro_batch": 8, "compile": True}
    assert suspects(base, 1) == []
    got = suspects({**base, "dp": 2, "tp": 2, "zero": 3, "micro_batch": 1, "compile": False}, 4)
    assert [s.split(":")[0] for s in got] == ["eager mode", "TP", "FSDP", "small micro-batch"]
    assert [s.split(":")[0] for s in suspects({**base, "dp": 4}, 4)] == ["DDP"]
    assert [s.split(":")[0] for s in suspects({**base, "pp": 2, "micro_batch": 2}, 2)] == \
        ["PP", "small micro-batch"]


def test_failed_note_names_the_out_of_memory_miss_and_its_bound():
    from trainplan.runbook import validation_text
    oom = {"config": "1gpu-mb16-c", "host": "2 x NVIDIA H100 80GB HBM3", "out_of_memory": True,
           "predicted_fits": True, "predicted_memory_gib": 77.574, "needed_gib": 79.8,
           "memory_error_at_most": 77.574 / 79.8 - 1, "reason": "out of memory (rc=1)"}
    text = validation_text.failed_note([oom])
    assert text.startswith("One launch failed") and "77.57 GiB" in text and "79.80" in text
    assert "would fit" in text and "2.8% or more" in text
    other = {**oom, "config": "broken", "out_of_memory": False, "memory_error_at_most": None,
             "reason": "rc=1: error: --steps must be > --warmup"}
    text = validation_text.failed_note([oom, other])
    assert text.startswith("2 configs' launches failed") and "broken on" in text
    assert "--steps" in text
    assert validation_text.failed_note([]) == "No launch of a measured config failed."


def test_layout_words_reads_a_config_without_its_tag():
    from trainplan.runbook.figures.validation import layout_words

    row = {"model": "data/models/llama3-8b.yaml:4-layers", "gpus": 4,
           "layout": {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero": 3, "dp_shard": 2,
                      "micro_batch": 2, "grad_accum": 8, "recompute": "selective",
                      "compile": True}}
    assert layout_words(row) == ("llama3-8b, 4 of its layers; 4 GPUs: TP2 x FSDP dp2, "
                                 "micro-batch 2 x 8 accumulated, selective recompute, compiled")
    one = {"model": "llama-1.3b", "gpus": 1, "layout": {"micro_batch": 16, "compile": False}}
    assert layout_words(one) == "llama-1.3b; 1 GPU: micro-batch 16"


def test_families_sentence_sorts_families_by_the_bar():
    from trainplan.runbook.trust_text import families_sentence

    def band(fam, step, mem, validated=True):
        return {"family": fam, "card_class": "Hopper", "validated": validated,
                "within_targets": step <= 0.10 and mem <= 0.10,
                "step_time_error": {"max": step}, "memory_error": {"max": mem}}

    text = families_sentence([band("HSDP", 0.02, 0.05), band("CP", 0.29, 0.04),
                              band("TP + CP", 0.16, 0.08, validated=False),
                              {**band("X", 0.0, 0.0), "card_class": "Ampere"}], "Hopper")
    assert text == ("Of the 3 layout families measured on Hopper GPUs, 1 is within 10% on step "
                    "time and memory (HSDP); CP misses it (step time 29%); 1 measured only "
                    "once, so not validated. The table below gives each family.")
    text = families_sentence([band("CP", 0.29, 0.04), band("FSDP", 0.05, 0.31),
                              band("PP", 0.12, None)], "Hopper")
    assert text == ("Of the 3 layout families measured on Hopper GPUs, none is within 10% on "
                    "step time and memory yet; 3 miss it, worst FSDP (memory 31%). The table "
                    "below gives each family.")
    assert families_sentence([], "Hopper") == "No layout family has been measured on Hopper " \
                                              "GPUs yet."


def test_real_data_note_reads_the_newest_record(tmp_path):
    import json

    from trainplan.runbook.quickstart import real_data_note

    assert "has not been measured" in real_data_note(tmp_path)
    run = tmp_path / "data" / "measurements" / "real-vs-proxy-x"
    (run / "train-log").mkdir(parents=True)
    (run / "proxy.jsonl").write_text(json.dumps({"gpus": 2, "card": "NVIDIA H200",
                                                 "warmup_steps_dropped": 1,
                                                 "tokens_per_s_per_gpu": 100.0}) + "\n")
    rows = [{"step": 1, "tokens_per_s_per_gpu": 5.0}, {"step": 2, "eval_loss": 1.0},
            {"step": 2, "tokens_per_s_per_gpu": 90.0}, {"step": 3, "tokens_per_s_per_gpu": 94.0}]
    (run / "train-log" / "training.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    assert real_data_note(tmp_path).startswith("On 2 x H200, the trainer on real shards ran at "
                                               "0.92 times the proxy's speed")


def _row(config, host, pred, meas):
    return {"config": config, "host": host, "flagged": False, "predicted_step_time_s": pred,
            "measured_step_time_s": meas, "measured_step_time_ci": [meas * 0.98, meas * 1.02],
            "predicted_split_s": {"compute": pred * 0.8, "exposed_comm": pred * 0.2,
                                  "bubble": 0.0, "optimizer": 0.0}}


def test_the_scatter_names_each_point_with_its_host_on_log_axes():
    import matplotlib.pyplot as plt

    from trainplan.runbook.figures.validation import predicted_vs_measured, short_host

    assert short_host("4 x NVIDIA H100 80GB HBM3") == "4xH100"
    assert short_host("2 x NVIDIA H200") == "2xH200" and short_host("cpu") == "cpu"
    rows = [_row("fsdp-z2-mb8-c", "2 x NVIDIA H100 80GB HBM3", 0.30, 0.31),
            _row("fsdp-z2-mb8-c", "2 x NVIDIA H200", 0.28, 0.26)]
    fig = predicted_vs_measured(rows)
    ax, key = fig.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    text = key.texts[0].get_text()
    assert "fsdp-z2-mb8-c (2xH100)" in text and "fsdp-z2-mb8-c (2xH200)" in text
    plt.close(fig)


def test_the_split_figure_grows_a_third_of_an_inch_a_config():
    import matplotlib.pyplot as plt

    from trainplan.runbook.figures.validation import validation_split

    heights = []
    for n in (4, 40):
        fig = validation_split([_row(f"c{i}", "4 x NVIDIA H200", 0.2, 0.21) for i in range(n)])
        heights.append(fig.get_size_inches()[1])
        plt.close(fig)
    assert abs((heights[1] - heights[0]) / 36 - 0.36) < 1e-9


def _compared(config, model, host, step_error, memory_error, **extra):
    return {"config": config, "model": model, "host": host, "predicted_step_time_s": 1.0,
            "step_time_error": step_error, "memory_error": memory_error, "launches": 3,
            **extra}


def test_page_four_and_its_appendix_glue_one_headline():
    from trainplan.compare import views

    rows = [_compared("a", "llama-1.3b", "4 x H100", -0.3, 0.1),
            _compared("b", "llama-1.3b", "4 x H100", 0.1, -0.2),
            _compared("c", "llama-1.3b", "2 x H200", 0.5, 0.0),
            _compared("old", "llama-1.3b", "4 x H100", 0.9, 0.9, superseded_by="a"),
            _compared("s", "llama-13b:4-layers", "4 x H100", 0.2, -0.1)]
    error = {"step_time_error": {"median": 0.1, "max": 0.5},
             "memory_error": {"median": 0.1, "max": 0.2}}
    out = {"rows": rows, "headline_host": "4 x H100", "refused": [], "superseded": 1,
           "flagged_configs": 0, "all_hosts": {"configs": 3, **error},
           "hosts": {"4 x H100": {"configs": 2, **error}, "2 x H200": {"configs": 1, **error}}}
    split = views.split_rows(out)
    assert [r["config"] for r in split["current"]] == ["a", "b", "c"], "no slice, no old series"
    assert [r["config"] for r in split["sliced"]] == ["s"]
    assert [r["config"] for r in split["head_rows"]] == ["a", "b"]
    values = vt.headline_values(out, split)
    assert values["step_worst"] == "c" and values["head_step_worst"] == "a"
    assert values["head_mem_worst"] == "b" and values["n_optimistic"] == 1
    assert values["n_launches"] == 9 and values["slice_base"] == "llama-13b"
    assert values["hosts_list"] == "4 x H100 (2 configurations) and 2 x H200 (1)"
    assert vt.headline_values(out, {**split, "sliced": []})["slice_base"] is None
