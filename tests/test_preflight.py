"""Checks that run before a model loads (stapo/run/preflight.py) and storage failures while running.

A user's mistake that needs no model to find (an output folder that cannot be written, ``trainer.device=cuda``
without a GPU, a model folder without weights, ``prompt_style=chat`` with a tokenizer that has no chat template,
no training prompt left) is one line naming the key, raised before the model loads — the tests make loading the
model fail loudly to prove the order. A full disk during a checkpoint save (a real process whose file-size limit
refuses the checkpoint's files) is one line, exit 1, and the previous checkpoint stays usable.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from stapo.run import preflight
from stapo.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


# --- the checks themselves --------------------------------------------------------------------------------------
def test_check_writable_creates_nothing_and_leaves_no_probe(tmp_path):
    assert preflight.check_writable(tmp_path / "a" / "b", "trainer.output_dir") == tmp_path / "a" / "b"
    (tmp_path / "c").mkdir()
    preflight.check_writable(tmp_path / "c", "trainer.output_dir")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["c"]  # probes in tmp_path and c removed, a/ not made


def test_check_writable_names_the_key_and_the_file_in_the_way(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError) as err:
        preflight.check_writable(tmp_path / "afile" / "runs", "trainer.output_dir")
    assert str(err.value) == (f"invalid value for 'trainer.output_dir': cannot write to {tmp_path}/afile/runs: "
                              f"{tmp_path}/afile is a file; choose a writable folder")


def test_check_writable_in_a_process_that_may_not_write_files(tmp_path):
    """A real process whose file-size limit is 0 (as a full disk or a quota: a file can be created, no byte
    written; Python ignores SIGXFSZ, so the write fails with EFBIG)."""
    code = ("import sys; from stapo.run.preflight import check_writable\n"
            "try:\n    check_writable(sys.argv[1], 'trainer.output_dir')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "runs")], capture_output=True, text=True,
                         cwd=REPO, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    assert out.stdout.strip() == (f"ConfigError invalid value for 'trainer.output_dir': cannot write to "
                                  f"{tmp_path}/runs: [Errno 27] File too large; choose a writable folder"), out.stderr
    assert list(tmp_path.iterdir()) == []  # the empty probe was removed, runs/ not made


def test_check_device(monkeypatch):
    import torch

    preflight.check_device("cpu", "trainer.device")
    preflight.check_device("auto", "trainer.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError) as err:
        preflight.check_device("cuda", "trainer.device")
    assert str(err.value) == ("invalid value for 'trainer.device' (cuda): torch sees no GPU (CUDA_VISIBLE_DEVICES=''); "
                              "use trainer.device=auto or trainer.device=cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    preflight.check_device("cuda:1", "engine.device")
    with pytest.raises(ConfigError, match=r"^invalid value for 'engine.device' \(cuda:2\): 2 GPU\(s\) visible; "
                                          r"use cuda:0..cuda:1, auto or cpu$"):
        preflight.check_device("cuda:2", "engine.device")


def test_check_chat_template():
    class Tok:
        chat_template = None

    for style in ("plain", "auto", False):
        preflight.check_chat_template(Tok(), style, "data.prompt_style", "m")
    with pytest.raises(ConfigError) as err:
        preflight.check_chat_template(Tok(), "chat", "data.prompt_style", "/models/base")
    assert str(err.value) == ("invalid value for 'data.prompt_style' (chat): the tokenizer of /models/base has no "
                              "chat template (a base model?); use data.prompt_style=plain")
    Tok.chat_template = "{{ messages }}"
    preflight.check_chat_template(Tok(), "chat", "data.prompt_style", "m")


# --- the trainer runs them before loading a model ----------------------------------------------------------------
@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading any model (the tiny one or a folder) fails the test: the error must come before it. Patched where
    each caller looks the loaders up: the trainer's module-level names, and stapo.model.models for the evaluation
    (imported first, so that no module binds the patch for good)."""
    import stapo.model.models
    import stapo.train.trainer

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    for module in (stapo.model.models, stapo.train.trainer):
        monkeypatch.setattr(module, "build_tiny_model", fail)
        monkeypatch.setattr(module, "load_policy", fail)


def _embedded_copy(folder: Path, chat_template: bool = True, weights: bool = True) -> Path:
    """An HF folder of links to the embedded model's files, optionally without its chat template or weights."""
    from stapo.model.models import embedded_model_path

    src = embedded_model_path()
    folder.mkdir()
    for f in src.iterdir():
        if f.name == "chat_template.jinja" and not chat_template:
            continue
        if f.suffix == ".safetensors" and not weights:
            continue
        if f.name == "tokenizer_config.json" and not chat_template:
            cfg = json.loads(f.read_text())
            cfg.pop("chat_template", None)
            (folder / f.name).write_text(json.dumps(cfg))
            continue
        (folder / f.name).symlink_to(f)
    return folder


def _trainer(tmp_path, overrides):
    from stapo.train import Trainer

    cfg = load_config(REPO / "configs" / "tiny_test.yaml",
                      [f"trainer.output_dir={tmp_path / 'runs'}", "trainer.run_name=r", *overrides])
    return Trainer(cfg)


def test_trainer_device_without_a_gpu_fails_before_the_model(tmp_path, monkeypatch, no_model_loads):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^invalid value for 'trainer.device' \(cuda\): "):
        _trainer(tmp_path, ["trainer.device=cuda"])


def test_trainer_unwritable_output_fails_before_the_model(tmp_path, no_model_loads):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path / "afile", [])
    assert str(err.value) == (f"invalid value for 'trainer.output_dir': cannot write to {tmp_path}/afile/runs/r: "
                              f"{tmp_path}/afile is a file; choose a writable folder")


def test_trainer_model_folder_without_weights_fails_before_the_model(tmp_path, no_model_loads):
    folder = _embedded_copy(tmp_path / "noweights", weights=False)
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, [f"model.path={folder}"])
    assert str(err.value) == (f"invalid value for 'model.path' ({folder}): model folder {folder} has config.json but "
                              f"no weights (*.safetensors / pytorch_model*.bin); an incomplete download or copy?")


def test_trainer_chat_style_without_a_chat_template_fails_before_the_model(tmp_path, no_model_loads):
    folder = _embedded_copy(tmp_path / "base", chat_template=False)
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, [f"model.path={folder}", "data.prompt_style=chat"])
    assert str(err.value) == (f"invalid value for 'data.prompt_style' (chat): the tokenizer of {folder} has no chat "
                              f"template (a base model?); use data.prompt_style=plain")


def test_trainer_no_training_prompt_fails_before_the_model(tmp_path, no_model_loads):
    from stapo.tasks.data import DataError

    with pytest.raises(DataError, match=r"^no training prompts from data.train_set=synthetic: 16 rows read, 0 skipped, "
                                        r"16 longer than data.max_prompt_length=2 tokens; raise data.max_prompt_length$"):
        _trainer(tmp_path, ["data.max_prompt_length=2"])


def test_evaluate_py_chat_style_without_a_chat_template_is_one_line(tmp_path):
    folder = _embedded_copy(tmp_path / "base", chat_template=False)
    out = subprocess.run([sys.executable, str(REPO / "evaluate.py"), "--config", str(REPO / "configs/eval/tiny_test.yaml"),
                          "--model", str(folder), "--output", str(tmp_path / "eval"), "--limit", "1",
                          "--data-root", str(REPO.parent / "shared" / "data"), "prompt.style=chat"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"evaluate.py: error: invalid value for 'prompt.style' (chat): the tokenizer of {folder} has no chat "
        f"template (a base model?); use prompt.style=plain")


# --- storage failures while running ------------------------------------------------------------------------------
def test_a_metrics_write_on_a_full_device_names_the_file(tmp_path):
    """/dev/full refuses every write with ENOSPC, as a full disk does."""
    from stapo.run.tracking import Tracker

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    tracker = Tracker(tmp_path, {}, mode="disabled")
    tracker.metrics_path = Path("/dev/full")
    with pytest.raises(OSError) as err:
        tracker.log(1, {"a": 1.0})
    assert err.value.errno == 28
    assert str(err.value) == "[Errno 28] cannot write /dev/full: No space left on device"


def test_train_py_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """Step 1 is saved; the resumed process may write files of at most 2 MiB (``ulimit -f``), so the step-2
    checkpoint (a 12 MiB weight file) fails mid-write: one line naming the folder and the OS error, exit 1, the
    partial folder gone, step 1 intact; without the limit ``--resume`` redoes step 2, one metrics row per step."""
    base = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny_test.yaml"),
            f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]
    env = {**os.environ, "STAPO_DEBUG": "0"}
    first = subprocess.run(base + ["trainer.total_steps=1"], capture_output=True, text=True, cwd=REPO, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    limit = 2 * 2**20
    full = subprocess.run(base + ["trainer.total_steps=2", "--resume"], capture_output=True, text=True, cwd=REPO,
                          env=env, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    ckpts = tmp_path / "r" / "checkpoints"
    assert full.returncode == 1, full.stderr[-3000:]
    assert full.stderr.strip().splitlines()[-1] == (
        f"train.py: CheckpointSaveError: saving checkpoint {ckpts / 'step_000002'} failed: [Errno 27] File too "
        f"large; the partial folder was removed and the latest checkpoint {ckpts / 'step_000001'} is intact; free "
        f"space (or fix the file system) and rerun (--resume continues from the latest checkpoint) (rerun with "
        f"--debug or STAPO_DEBUG=1 for the traceback)")
    assert "Traceback" not in full.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001"]
    again = subprocess.run(base + ["trainer.total_steps=2", "--resume"], capture_output=True, text=True, cwd=REPO,
                           env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2] and sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002"]


# --- model sources ------------------------------------------------------------------------------------------------
def test_a_truncated_weight_file_is_named_with_its_size(tmp_path):
    folder = _embedded_copy(tmp_path / "damaged", weights=False)
    from stapo.model.models import embedded_model_path

    with open(embedded_model_path() / "model.safetensors", "rb") as src:
        (folder / "model.safetensors").write_bytes(src.read(1_000_000))  # the first MB of a 540 MB file
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, [f"model.path={folder}"])
    assert str(err.value).startswith(f"invalid value for 'model.path' ({folder}): {folder}/model.safetensors "
                                     f"(1000000 bytes) is damaged or truncated: ")
    assert str(err.value).endswith("; copy the folder again or use another checkpoint")


def _tiny_folder(folder: Path, **config_changes) -> Path:
    """The tiny Qwen3 model saved as an HF folder, then its config.json edited (``None`` deletes a key)."""
    from stapo.model.models import build_tiny_model

    model, tok = build_tiny_model()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_config_json_of_another_model_size_is_named_with_the_mismatch(tmp_path):
    """config.json says intermediate_size 256, the weights hold 128. Before: transformers' "For details look at the
    above report!" with the report hidden (train.py exit 1)."""
    folder = _tiny_folder(tmp_path / "resized", intermediate_size=256)
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, [f"model.path={folder}"])
    assert str(err.value) == (
        f"invalid value for 'model.path' ({folder}): {folder}: config.json does not match the weights (another model "
        f"size? a config.json edited or copied from another model): 6 tensor(s) of another shape "
        f"(model.layers.0.mlp.down_proj.weight: [64, 128] in the weights, [64, 256] by config.json)")


def test_a_config_json_with_more_or_fewer_layers_than_the_weights_is_refused(tmp_path):
    """More layers than the weights hold would be randomly initialised, fewer would drop weights: both were loaded
    without a word (transformers' report is quiet here)."""
    from stapo.model.models import load_policy

    more = _tiny_folder(tmp_path / "more", num_hidden_layers=3, layer_types=None, max_window_layers=None)
    with pytest.raises(ValueError, match=r"11 tensor\(s\) that config.json expects are missing from the weights "
                                         r"\(e.g. model.layers.2.input_layernorm.weight; they would be random\)$"):
        load_policy(str(more))
    fewer = _tiny_folder(tmp_path / "fewer", num_hidden_layers=1, layer_types=None, max_window_layers=None)
    with pytest.raises(ValueError, match=r"11 tensor\(s\) of the weights have no place in config.json's model "
                                         r"\(e.g. model.layers.1.input_layernorm.weight; they would be dropped\)$"):
        load_policy(str(fewer))


def test_an_unusable_model_cache_names_model_cache_dir(tmp_path, no_model_loads):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, [f"model.cache_dir={tmp_path / 'afile' / 'cache'}"])
    assert str(err.value) == (f"invalid value for 'model.cache_dir' ({tmp_path}/afile/cache): cannot create the "
                              f"model cache {tmp_path}/afile/cache (Not a directory); set model.cache_dir or "
                              f"STAPO_CACHE_DIR to a writable folder")


def test_a_hub_id_fails_fast_without_network_and_a_local_looking_path_is_not_a_hub_id(tmp_path, monkeypatch):
    import stapo.model.models as models

    monkeypatch.setattr(models, "_hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(OSError) as err:
        models.load_tokenizer("nosuch-org/nosuch-model", cache_dir=tmp_path / "hf")
    assert str(err.value) == ("cannot load hub id 'nosuch-org/nosuch-model': the Hugging Face hub cannot be reached "
                              "and the model is not in the HF cache; give a local model folder, or download it "
                              "where there is network")
    monkeypatch.undo()  # the real check: HF_HUB_OFFLINE alone says unreachable, with no connection tried
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models._hub_reachable() is False
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        models.load_tokenizer("runs/typo")
    assert str(err.value) == "model path 'runs/typo' does not exist (its folder runs/ is local, so it is not a hub id)"


def test_a_run_folder_held_by_another_process_is_refused_before_the_model(tmp_path, no_model_loads):
    from stapo.run.runlock import RunLockError

    run_dir = tmp_path / "runs" / "r"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom stapo.run.runlock import RunLock\n"
                               "RunLock(sys.argv[1], 'holder.py').acquire()\nprint('held', flush=True)\n"
                               "time.sleep(600)\n", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockError, match=rf"^{run_dir} is in use by holder.py \(pid {holder.pid} on host "):
            _trainer(tmp_path, [])
    finally:
        holder.kill()
        holder.wait()


# --- run folders of the other program, damaged sources, signals, torn reports (found by a new-user check) ---------
def test_a_tokenizer_that_encodes_to_nothing_is_refused_before_the_model(tmp_path, no_model_loads):
    folder = tmp_path / "notok"
    folder.mkdir()
    from stapo.model.models import embedded_model_path

    for name in ("config.json", "model.safetensors"):  # the weights, but none of the tokenizer files
        (folder / name).symlink_to(embedded_model_path() / name)
    with pytest.raises(ConfigError) as err:  # transformers refuses this one itself ("Couldn't instantiate ...")
        _trainer(tmp_path, [f"model.path={folder}"])
    assert str(err.value).startswith(f"invalid value for 'model.path' ({folder}): ") and "\n" not in str(err.value)

    class NoVocabulary:  # what a Qwen3 checkpoint without its tokenizer files loads as
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": []}

    with pytest.raises(ConfigError) as err:
        preflight.check_tokenizer(NoVocabulary(), "model.path", "/ckpt")
    assert str(err.value) == ("invalid value for 'model.path' (/ckpt): its tokenizer encodes text to no tokens (are "
                              "tokenizer.json / tokenizer_config.json missing from the folder?)")


def test_train_and_evaluate_never_share_a_folder(tmp_path, no_model_loads):
    import importlib.util

    ev = tmp_path / "runs" / "r"
    ev.mkdir(parents=True)
    (ev / "eval_manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"^invalid value for 'trainer.run_name' \(r\): {ev} is an evaluate.py "
                                          r"output folder \(eval_manifest.json\)"):
        _trainer(tmp_path, [])
    run = tmp_path / "train_run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    spec = importlib.util.spec_from_file_location("_evaluate_cli", REPO / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--config", str(REPO / "configs/eval/tiny_test.yaml"), "--output", str(run), "--limit", "1",
                        "--data-root", str(REPO.parent / "shared" / "data"), "--wandb", "disabled"]) == 2
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_evaluating_a_run_folder_skips_a_damaged_latest_checkpoint(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tests"))
    from toy_run import make_trainer

    from stapo.evaluation import EvalError
    from stapo.evaluation.model_source import resolve_model_source

    make_trainer(str(tmp_path), ["trainer.total_steps=2", "trainer.save_every=1"]).train()
    run = tmp_path / "toy"
    weights = run / "checkpoints" / "step_000002" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle: same size, another checksum
    weights.write_bytes(bytes(data))
    source = resolve_model_source(str(run))
    assert source.step == 1 and source.path.endswith("step_000001")
    err = capsys.readouterr().err
    assert "step_000002 is damaged (model.safetensors does not match its checksum" in err
    assert err.rstrip().endswith("; trying the one before")
    with pytest.raises(EvalError, match=r"step_000002 is damaged: model.safetensors does not match its checksum"):
        resolve_model_source(str(weights.parent))


def test_sigterm_as_interrupt_raises_and_the_step_loop_still_takes_over(tmp_path):
    import signal

    from stapo.run.cli import Terminated, raise_terminated, sigterm_as_interrupt

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        sigterm_as_interrupt()
        assert signal.getsignal(signal.SIGTERM) is raise_terminated
        with pytest.raises(Terminated) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            import time
            time.sleep(1)  # the handler runs here
        assert info.value.signum == signal.SIGTERM and isinstance(info.value, KeyboardInterrupt)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_failed_report_write_keeps_the_previous_file_and_names_it(tmp_path):
    from stapo.evaluation.report import _atomic

    path = tmp_path / "results.json"
    path.write_text("old")
    with pytest.raises(OSError) as err:
        with _atomic(path) as tmp:
            tmp.write_text("half")
            raise OSError(28, "No space left on device")
    assert str(err.value) == f"[Errno 28] cannot write {path}: No space left on device"
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_resume_drops_repeated_rows_of_a_step(tmp_path, capsys):
    from stapo.run.tracking import Tracker

    tracker = Tracker(tmp_path, {}, mode="disabled")
    rows = [{"step": 1, "a": 1}, {"step": 1, "a": 2}, {"step": 2, "a": 3}, {"step": 3, "a": 4}]
    tracker.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tracker.truncate_after(2)
    # by hand: step 3 is after the checkpoint; step 1 is there twice, the last row (a=2) is kept
    assert [json.loads(line) for line in tracker.metrics_path.read_text().splitlines()] == [
        {"step": 1, "a": 2}, {"step": 2, "a": 3}]
    assert "dropped 1 repeated row(s)" in capsys.readouterr().err


def test_a_config_json_that_contradicts_itself_is_one_line_naming_the_folder(tmp_path):
    """num_hidden_layers raised while layer_types keeps 2 entries: transformers' config validation fails. Before: exit
    1 with "StrictDataclassClassValidationError: ..." and no folder named."""
    from stapo.model.models import load_policy

    folder = _tiny_folder(tmp_path / "contradicts", num_hidden_layers=3)  # layer_types still lists 2 layers
    with pytest.raises(ValueError) as err:
        load_policy(str(folder))
    msg = str(err.value)
    assert msg.startswith(f"{folder}/config.json is not a valid model config: ") and "\n" not in msg, msg
    assert msg.endswith("; fix it or copy the folder again")
