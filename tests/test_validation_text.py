"""Page 4's record-dependent sentences say what is and is not measured."""

from trainplan import validation_text as vt


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
