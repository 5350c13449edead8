"""`trainplan launch`: what it writes for 13B on 32 H100s, and what it refuses.

No cluster runs here for Kubernetes: the manifest is checked field by field
against the Kubeflow PyTorchJob (kubeflow.org/v1) API it uses
(`pkg/apis/kubeflow.org/v1/pytorch_types.go` and the common `RunPolicy` /
`ReplicaSpec` types of the training operator).
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest
import yaml
from tests.launch.helpers import TINY_LAYOUT, launch, launch_json, tiny_yaml

from trainplan import cli

SCENARIO = ["--scenario", "llama-13b-32xh100", "--data", "shards/team"]


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    """The three targets for the runbook's scenario, generated once."""
    root = tmp_path_factory.mktemp("launch")
    out = {}
    for target in ("torchrun", "slurm", "k8s"):
        summary = launch_json([*SCENARIO, "--target", target, "--out", root / target], root)
        files = {f: (root / target / f).read_text() for f in summary["files"]}
        out[target] = (summary, files)
    return out


def _harness_part(text: str) -> str:
    return text[text.index("-m trainplan.train"):]


def test_the_plan_becomes_4_nodes_of_8(artefacts):
    for summary, files in artefacts.values():
        assert summary["nodes"] == 4 and summary["procs_per_node"] == 8
        assert "README.md" in files
        assert summary["plan"]["fits"]
        readme = files["README.md"]
        for part in ("## Start", "## Watch", "## Stop", "tokens/s per GPU", "GiB"):
            assert part in readme


def test_torchrun_script_has_rendezvous_restarts_and_nccl_settings(artefacts):
    summary, files = artefacts["torchrun"]
    text = files["torchrun.sh"]
    for part in ("--nnodes 4", "--nproc-per-node 8", "--rdzv-backend c10d",
                 '--rdzv-endpoint "$RDZV_HOST:$RDZV_PORT"', '--rdzv-id "$JOB_ID"',
                 "--max-restarts 3", "export NCCL_NVLS_ENABLE=0",
                 "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                 "export TORCH_NCCL_ASYNC_ERROR_HANDLING=3", "-m trainplan.train",
                 'DATA_DIR="${DATA_DIR:-shards/team}"', '--data "$DATA_DIR"'):
        assert part in text
    harness = _harness_part(text)
    for flag, value in zip(summary["harness_args"][::2], summary["harness_args"][1::2],
                           strict=False):
        if not value.startswith("--") and value not in ("DATA", "LOGS"):
            assert f"{flag} {shlex.quote(value)}" in harness


def test_slurm_script_has_the_batch_directives(artefacts):
    _, files = artefacts["slurm"]
    text = files["train.sbatch"]
    for part in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@600", "srun --ntasks-per-node=1",
                 "scontrol show hostnames", '--rdzv-id "$SLURM_JOB_ID"', "scontrol requeue",
                 "logs/%x-%j-%N.out"):
        assert part in text


def test_no_machine_paths_in_the_artefacts(artefacts, tmp_path):
    for _, files in artefacts.values():
        for text in files.values():
            assert str(tmp_path.parent) not in text and "/work/" not in text


# ---------------------------------------------------------------- Kubernetes, structurally

ELASTIC_POLICY = {"minReplicas": int, "maxReplicas": int, "rdzvBackend": str, "rdzvPort": int,
                  "rdzvHost": str, "rdzvId": str, "rdzvConf": list, "standalone": bool,
                  "nProcPerNode": int, "maxRestarts": int, "metrics": list}
RUN_POLICY = {"cleanPodPolicy": ("All", "Running", "None"), "ttlSecondsAfterFinished": int,
              "activeDeadlineSeconds": int, "backoffLimit": int, "schedulingPolicy": dict,
              "suspend": bool, "managedBy": str}
REPLICA_SPEC = {"replicas": int, "template": dict, "restartPolicy": str}
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")


def _check_fields(obj: dict, allowed: dict, where: str) -> None:
    """Every key is a field of the API, of its type (int32 fields: ints, not booleans)."""
    for key, value in obj.items():
        assert key in allowed, f"{where}.{key} is not a field of the v1 API"
        rule = allowed[key]
        if isinstance(rule, tuple):
            assert value in rule, f"{where}.{key} = {value!r} not in {rule}"
        elif rule is int:
            assert type(value) is int, f"{where}.{key} = {value!r} is not an integer"
        else:
            assert isinstance(value, rule), f"{where}.{key} = {value!r} is not {rule.__name__}"


def test_k8s_manifest_is_a_pytorchjob_v1_with_an_elastic_policy(artefacts):
    summary, files = artefacts["k8s"]
    job = yaml.safe_load(files["pytorchjob.yaml"])
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert set(job) == {"apiVersion", "kind", "metadata", "spec"}
    name = job["metadata"]["name"]
    assert len(name) <= 63 and name.replace("-", "").isalnum() and name.islower()
    spec = job["spec"]
    assert set(spec) <= {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"}
    _check_fields(spec["elasticPolicy"], ELASTIC_POLICY, "spec.elasticPolicy")
    _check_fields(spec["runPolicy"], RUN_POLICY, "spec.runPolicy")
    assert isinstance(spec["nprocPerNode"], str)  # *string in the API: "8", "gpu", "auto"
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}, "elastic jobs have workers only"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    _check_fields(worker, REPLICA_SPEC, "Worker")
    assert worker["restartPolicy"] in RESTART_POLICIES
    for key in ("rdzvConf",):
        for item in spec["elasticPolicy"][key]:
            assert set(item) <= {"key", "value"} and isinstance(item["value"], str)
    pol = spec["elasticPolicy"]
    assert pol["rdzvBackend"] == "c10d"
    assert pol["minReplicas"] == pol["maxReplicas"] == worker["replicas"] == summary["nodes"]

    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch", "the operator injects its env into 'pytorch'"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}
    assert all(isinstance(e["value"], str) for e in container["env"])
    assert {"name": "NCCL_NVLS_ENABLE", "value": "0"} in container["env"]
    cmd = container["command"]
    assert cmd[0] == "torchrun"

    def flag(name):
        return cmd[cmd.index(name) + 1]

    assert flag("--nnodes") == str(worker["replicas"])
    assert flag("--nproc-per-node") == spec["nprocPerNode"]
    assert flag("--rdzv-backend") == pol["rdzvBackend"]
    assert flag("--rdzv-endpoint") == f"{name}-worker-0:{pol['rdzvPort']}"
    assert flag("--rdzv-id") == pol["rdzvId"]
    assert flag("--max-restarts") == str(pol["maxRestarts"])
    assert pod["terminationGracePeriodSeconds"] > int(flag("--shutdown-timeout"))
    assert cmd[cmd.index("-m") + 1] == "trainplan.train"
    assert flag("--data") == "shards/team"


# ---------------------------------------------------------------- the CPU proxy


def test_cpu_artefacts_ask_for_no_gpus(tmp_path):
    model = tiny_yaml(tmp_path)
    summary = launch_json(["--model", model, "--gpus", "2", "--gpus-per-node", "2",
                           *TINY_LAYOUT, "--steps", "4", "--target", "slurm", "--out",
                           tmp_path / "s"], tmp_path)
    text = (tmp_path / "s" / "train.sbatch").read_text()
    assert "--gpus-per-node" not in text.split("srun")[0] and "--cpu" in text
    assert summary["nodes"] == 1 and summary["procs_per_node"] == 2


def test_force_replaces_a_folder_all_at_once(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    launch_json([*SCENARIO, "--target", "k8s", "--out", out, "--force"], tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "pytorchjob.yaml"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "temporary folders left behind"


# ---------------------------------------------------------------- bad requests

BAD = [
    (["--target", "docker"], ["'docker'", "torchrun", "slurm", "k8s"]),
    (["--target", "slurm", "--gpus", "12"], ["12", "gpus-per-node"]),
    (["--target", "slurm", "--tp", "3"], ["--tp 3"]),
    (["--target", "slurm", "--ep", "2"], ["ep=2", "--ep 1"]),
    (["--target", "slurm", "--dp", "32", "--zero", "0", "--micro-batch", "32",
      "--recompute", "none", "--tp", "1", "--pp", "1"], ["GiB", "fit"]),
    (["--target", "slurm", "--model", "gpt-17"], ["gpt-17"]),
    (["--target", "slurm", "--warn-s", "100", "--save-grace-s", "300"], ["--warn-s 100"]),
    (["--target", "slurm", "--env", "NOEQUALS"], ["NOEQUALS", "NAME=VALUE"]),
    (["--target", "slurm", "--env", "bad name=1"], ["bad name", "NAME=VALUE"]),
    (["--target", "k8s", "--job-name", "Bad_Name"], ["Bad_Name"]),
    (["--target", "slurm", "--steps", "-1"], ["'-1'"]),
    (["--target", "slurm", "--data", "a b"], ["'a b'", "--data"]),
    (["--target", "slurm", "--train-arg", "lr"], ["--train-arg", "FLAG=VALUE"]),
    (["--target", "slurm", "--scenario", "nowhere"], ["nowhere"]),
    (["--target", "slurm", "--rdzv-port", "80"], ["--rdzv-port 80"]),
    (["--target", "slurm", "--ckpt-keep", "1"], ["--ckpt-keep 1", "at least 2"]),
]


def _one_line_exit_2(proc, needles):
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("args,needles", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_request_is_one_line_exit_2_and_writes_nothing(args, needles, tmp_path):
    base = dict(zip(SCENARIO[::2], SCENARIO[1::2], strict=True))
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    argv = [x for kv in base.items() for x in kv] + ["--out", tmp_path / "out"]
    _one_line_exit_2(launch(argv, tmp_path), needles)
    assert list(tmp_path.iterdir()) == [], "something was written"


# ---------------------------------------------------------------- flags this run would not read

LA = ["launch", "--model", "llama-1.3b", "--gpu", "h100-sxm", "--gpus", "8", "--cpu",
      "--steps", "10"]
UNUSED = {  # flags given where nothing reads them: refused, not dropped
    "no-compile-on-cpu": (["--target", "torchrun", "--no-compile"],
                          "--no-compile is not used with --cpu"),
    "train-arg-without-data": (["--target", "torchrun", "--train-arg", "bogus=1"],
                               "--train-arg 'bogus=1' is not used without --data"),
    "warmup-with-data": (["--target", "slurm", "--data", "shards", "--warmup", "2"],
                         "--warmup 2 is not used with --data"),
    "warmup-default-with-data": (["--target", "slurm", "--data", "shards", "--warmup", "5"],
                                 "--warmup 5 is not used with --data"),
    "synthetic-with-data": (["--target", "k8s", "--data", "shards", "--synthetic"],
                            "--synthetic is not used with --data"),
    "image-torchrun": (["--target", "torchrun", "--image", "mine:1"],
                       "--image 'mine:1' is not used with --target torchrun; only --target k8s"),
    "image-slurm": (["--target", "slurm", "--image", "mine:1"], "only --target k8s reads"),
    "rdzv-port-k8s": (["--target", "k8s", "--rdzv-port", "29501"],
                      "--rdzv-port 29501 is not used with --target k8s; only --target "
                      "torchrun or slurm"),
    "warn-s-torchrun": (["--target", "torchrun", "--warn-s", "9999"],
                        "--warn-s 9999 is not used with --target torchrun; only --target slurm"),
    "warn-s-k8s": (["--target", "k8s", "--warn-s", "900"], "--warn-s 900 is not used"),
    "time-limit-torchrun": (["--target", "torchrun", "--time-limit-min", "60"],
                            "--time-limit-min 60 is not used with --target torchrun"),
    "time-limit-k8s": (["--target", "k8s", "--time-limit-min", "60"],
                       "--time-limit-min 60 is not used with --target k8s; only --target slurm"),
}


@pytest.mark.parametrize("case", list(UNUSED), ids=list(UNUSED))
def test_a_flag_this_run_does_not_read_is_one_line_exit_2(case, tmp_path, capsys):
    argv, words = UNUSED[case]
    assert cli.main([*LA, *argv, "--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainplan: error:"), err
    assert "Traceback" not in err and words in err, err
    assert list(tmp_path.iterdir()) == [], "something was written"


@pytest.mark.parametrize("argv", [["--target", "torchrun", "--data", "shards", "--steps", "3"],
                                  ["--target", "torchrun", "--save-grace-s", "700"],
                                  ["--target", "k8s", "--save-grace-s", "700"]],
                         ids=["data-few-steps", "grace-torchrun", "grace-k8s"])
def test_checks_of_flags_not_read_do_not_refuse(argv, tmp_path, capsys):
    """--warmup is not checked against --steps with --data (the trainer has no warm-up), nor
    --warn-s against --save-grace-s on a target without a time limit."""
    assert cli.main([*LA, *argv, "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "README.md").is_file()


VARIED = {"--rdzv-port": ("rdzv_port", 29511), "--time-limit-min": ("time_limit_min", 60),
          "--warn-s": ("warn_s", 900), "--image": ("image", "registry.example/mine:1.0")}


@pytest.mark.parametrize("target", ["torchrun", "slurm", "k8s"])
def test_target_flags_table_is_what_each_target_reads(target):
    """`render.TARGET_FLAGS` against the artefacts: each flag listed for the target changes
    them, and every other target flag changed at once leaves them byte-identical."""
    from trainplan.calibrate.store import load_gpu
    from trainplan.launch import artefacts
    from trainplan.launch.render import TARGET_FLAGS
    from trainplan.specs import cluster_for, load_cluster, load_model

    assert set(VARIED) == {f for flags in TARGET_FLAGS.values() for f in flags}
    gpu = load_gpu("h100-sxm", calibration=None)
    cluster, m = load_cluster(cluster_for(gpu, None)[0]), load_model("llama-1.3b")
    base = artefacts.LaunchSettings(target=target, steps=10, cpu=True)

    def files(**changed):
        return artefacts.plan_and_generate(
            m, gpu, cluster, gpus=8, seq_len=4096, global_batch_tokens=4 * 2**20,
            settings=dataclasses.replace(base, **changed), model_arg="llama-1.3b").files

    before = files()
    for flag in TARGET_FLAGS[target]:
        assert files(**dict([VARIED[flag]])) != before, f"{target} does not read {flag}"
    unread = dict(v for f, v in VARIED.items() if f not in TARGET_FLAGS[target])
    assert files(**unread) == before, f"{target} reads one of {sorted(unread)}"


def test_context_parallel_launches_on_gpus_and_is_refused_on_cpu(tmp_path):
    """--cp 2 is in the trainer's flags of a GPU launch; with --cpu it is one line, exit 2."""
    summary = launch_json([*SCENARIO, "--target", "slurm", "--cp", "2", "--out",
                           tmp_path / "gpu"], tmp_path)
    text = (tmp_path / "gpu" / "train.sbatch").read_text()
    assert summary["plan"]["parallel"]["cp"] == 2 and "--cp 2" in _harness_part(text)
    _one_line_exit_2(launch([*SCENARIO, "--target", "slurm", "--cp", "2", "--cpu", "--out",
                             tmp_path / "cpu"], tmp_path), ["--cp 2 with --cpu", "GPUs only"])
    assert not (tmp_path / "cpu").exists()


def test_non_empty_out_without_force_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _one_line_exit_2(launch([*SCENARIO, "--target", "slurm", "--out", out], tmp_path),
                     ["not empty", "--force"])
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_out_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "file"
    out.write_text("x")
    _one_line_exit_2(launch([*SCENARIO, "--target", "slurm", "--out", out], tmp_path),
                     ["is a file"])


def test_a_plan_file_sets_the_layout(tmp_path):
    """`trainplan plan --json` written to a file, then `launch --plan FILE`: the file's
    decision is what the scripts run (its layout pinned whole), not the search's own choice;
    a file without a decision gives its first plan."""
    import json
    import subprocess
    import sys

    from tests.launch.helpers import run_env

    answer = subprocess.run([sys.executable, "-m", "trainplan.cli", "plan", "--model",
                             "llama-13b", "--gpu", "h100-sxm", "--gpus", "32", "--zero", "2",
                             "--top", "1", "--json"], capture_output=True, text=True,
                            env=run_env(), check=True).stdout
    (tmp_path / "plan.json").write_text(answer)
    want = json.loads(answer)["decision"]["plan"]["parallel"]
    got = launch_json(["--plan", tmp_path / "plan.json", "--model", "llama-13b", "--gpu",
                       "h100-sxm", "--data", "shards", "--steps", "10", "--target", "slurm",
                       "--out", tmp_path / "job"], tmp_path)
    assert got["plan"]["parallel"] == want and want["zero"] == 2
    first = {k: v for k, v in json.loads(answer).items() if k != "decision"}
    (tmp_path / "first.json").write_text(json.dumps(first))
    got = launch_json(["--plan", tmp_path / "first.json", "--model", "llama-13b", "--gpu",
                       "h100-sxm", "--data", "shards", "--steps", "10", "--target", "slurm",
                       "--out", tmp_path / "job1"], tmp_path)
    assert got["plan"]["parallel"] == first["plans"][0]["parallel"]
    (tmp_path / "bad.json").write_text("{}")
    _one_line_exit_2(launch(["--plan", tmp_path / "bad.json", "--model", "llama-13b", "--gpu",
                             "h100-sxm", "--steps", "10", "--target", "slurm", "--out",
                             tmp_path / "job2"], tmp_path), ["--plan", "trainplan plan"])


def test_the_plan_is_priced_for_the_allocator_the_scripts_set(artefacts, tmp_path):
    """The scripts set expandable segments and the plan is priced so; a user's --env
    choosing PyTorch's default allocator prices the plan for it (more reserved memory)."""
    summary, files = artefacts["torchrun"]
    conf = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
    mine = launch_json([*SCENARIO, "--target", "torchrun", "--env", conf, "--out",
                        tmp_path / "t"], tmp_path)
    text = (tmp_path / "t" / "torchrun.sh").read_text()
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in text
    assert "expandable_segments:True" not in text
    same = summary["plan"]["parallel"] == mine["plan"]["parallel"]
    more = mine["plan"]["memory_gib"]["total"] > summary["plan"]["memory_gib"]["total"]
    assert more or not same  # the default allocator holds more, or another layout was chosen


@pytest.mark.parametrize("field", ["name", "title"])
def test_a_spec_string_with_a_newline_cannot_reach_a_job_script(field, tmp_path):
    """A model's name and a scenario's title head every generated script: a newline there
    would end the comment and run what follows (shell injection), so the spec is refused."""
    evil = f"x\n$(touch {tmp_path / 'PWNED'})\necho"
    if field == "name":
        spec = tmp_path / "m.yaml"
        spec.write_text(yaml.safe_dump({"name": evil, "n_layers": 2, "hidden": 32, "n_heads": 2,
                                        "ffn": 64, "vocab": 256}))
        argv = ["--model", spec, "--gpu", "h100-sxm", "--gpus", "8"]
    else:
        root = Path(__file__).resolve().parents[2]
        scenario = yaml.safe_load((root / "data/scenarios/llama-13b-32xh100.yaml").read_text())
        spec = tmp_path / "s.yaml"
        spec.write_text(yaml.safe_dump({**scenario, "title": evil}))
        argv = ["--scenario", spec]
    out = tmp_path / "out"
    _one_line_exit_2(launch([*argv, "--target", "slurm", "--steps", "10", "--out", out],
                            tmp_path), [f"{field} = ", "control characters"])
    assert not out.exists() and not (tmp_path / "PWNED").exists()
