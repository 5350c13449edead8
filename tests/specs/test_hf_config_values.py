"""A hand-edited Hugging Face config.json read as a model: a `model_type` of the wrong JSON
type is one SpecError line (and exit 2 at the command line) naming the value."""

from __future__ import annotations

import json

import pytest

from trainplan import cli
from trainplan.errors import SpecError
from trainplan.specs.hf import model_from_hf

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256}


@pytest.mark.parametrize("model_type, shown", [(["llama"], "['llama']"), ({"a": 1}, "{'a': 1}"),
                                               (None, "None"), (7, "7")])
def test_a_model_type_that_is_not_a_string_is_one_line(tmp_path, model_type, shown):
    file = tmp_path / "config.json"
    file.write_text(json.dumps(dict(LLAMA, model_type=model_type)))
    with pytest.raises(SpecError) as err:
        model_from_hf(file)
    text = str(err.value)
    assert "\n" not in text and f"model_type = {shown}" in text and "'llama'" in text, text


def test_the_plan_verb_refuses_it_with_exit_2(tmp_path, capsys):
    file = tmp_path / "config.json"
    file.write_text(json.dumps(dict(LLAMA, model_type=["llama"])))
    assert cli.main(["plan", "--model", str(file), "--gpu", "h100-sxm", "--gpus", "8"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert "model_type = ['llama']" in err and str(file) in err, err
