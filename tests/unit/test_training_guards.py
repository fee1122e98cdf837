"""Training's readers and resume guards: odd prompt files for ``training.evaluate``, errors in its engine
process, and a checkpoint trained on another draft vocabulary (CPU only: no Ray, no vLLM engine)."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from tests.helpers.training import AUX_IDS
from training import evaluate
from training.checkpoint import LoopState, load_checkpoint, save_checkpoint
from training.model import Eagle3Drafter
from training.vocab import mapping_from_ids


def test_a_prompts_file_without_prompts_is_one_clear_error(tmp_path):
    """An empty file (or ``[]``) used to read as no prompts: two vLLM engines then started to report NaN."""
    for name, body in {"empty.jsonl": "", "blank.jsonl": "\n\n", "none.json": "[]"}.items():
        (tmp_path / name).write_text(body)
        with pytest.raises(evaluate.PromptFileError, match=f"{name}: holds no prompts"):
            evaluate.read_prompts(tmp_path / name)


def test_json_booleans_are_not_token_ids(tmp_path):
    (tmp_path / "bools.json").write_text("[[true, false, 5]]")
    with pytest.raises(evaluate.PromptFileError, match="prompt 1 is not a non-empty list of token ids"):
        evaluate.read_prompts(tmp_path / "bools.json")


def test_the_cli_refuses_prompts_that_do_not_fit_before_any_engine_starts(tmp_path, monkeypatch):
    def engines(*args, **kwargs):
        raise AssertionError("the vLLM engines were started")

    monkeypatch.setattr(evaluate, "evaluate", engines)
    (tmp_path / "long.json").write_text(f"[[1, 2], {[5] * 1000}]")
    with pytest.raises(SystemExit, match="prompt 2 has 1000 tokens: with --max-tokens 64 it needs --max-model-len "
                                         "1064 or more"):
        evaluate.main(["--target", str(tmp_path), "--draft", str(tmp_path), "--prompts", str(tmp_path / "long.json")])
    (tmp_path / "config.json").write_text('{"vocab_size": 100}')  # --target for the random prompts' vocabulary
    with pytest.raises(SystemExit, match="no prompts"):
        evaluate.main(["--target", str(tmp_path), "--draft", str(tmp_path), "--num-random-prompts", "0"])


def test_an_error_while_measuring_reaches_the_parent(monkeypatch):
    """vLLM refuses a too-long prompt in the engine process; the parent used to learn only its exit code."""

    class RefusingEngine:
        def generate(self, *args, **kwargs):
            raise ValueError("The decoder prompt (length 2000) is longer than the maximum model length of 1024.")

    monkeypatch.setattr(evaluate, "make_engine", lambda *a, **k: RefusingEngine())
    monkeypatch.setattr(evaluate, "shutdown_engine", lambda llm: None)
    pytest.importorskip("vllm")
    results: queue.Queue = queue.Queue()
    with pytest.raises(ValueError):
        evaluate._child("target", "draft", [[5] * 2000], 3, 8, 1024, "float32", False, results)
    assert "longer than the maximum model length" in results.get_nowait()["error"]


def _drafter(draft_ids: list[int]) -> Eagle3Drafter:
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_hidden_layers=1)
    config.draft_vocab_size, config.target_hidden_size = len(draft_ids), 32
    config.eagle_aux_hidden_state_layer_ids = AUX_IDS
    drafter = Eagle3Drafter(config)
    vocab = mapping_from_ids(np.array(draft_ids), 50)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    return drafter


def _optim(drafter: Eagle3Drafter):
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def test_a_checkpoint_of_another_draft_vocabulary_is_not_resumed(tmp_path):
    """train_loop distils from the run's vocabulary's lm_head rows; resuming used to swap in the checkpoint's d2t."""
    old = _drafter([1, 2, 3, 4])
    save_checkpoint(tmp_path, old, *_optim(old), LoopState(step=2), {})
    same = _drafter([1, 2, 3, 4])
    assert load_checkpoint(tmp_path, same, *_optim(same)).step == 2
    run = _drafter([10, 20, 30, 40])
    with pytest.raises(ValueError, match="another draft vocabulary"):
        load_checkpoint(tmp_path, run, *_optim(run))
    assert (torch.arange(4) + run.d2t).tolist() == [10, 20, 30, 40]


def test_a_resume_takes_the_vocabulary_of_the_newest_checkpoint_that_reads(tmp_path):
    """A kill may leave the newest step folder half-copied: the next older checkpoint (same training, same mapping)
    gives the vocabulary, not a count made again."""
    from safetensors.torch import save_file

    from training.checkpoint import MODEL_FILE
    from training.train import RUN_NAME, checkpoint_vocab

    runs = tmp_path / "ray" / RUN_NAME
    assert checkpoint_vocab(tmp_path, 4) is None  # no checkpoint
    mapping = mapping_from_ids(np.array([1, 3, 4, 5]), 10)
    (runs / "step_0000003").mkdir(parents=True)
    save_file({"d2t": mapping.d2t, "t2d": mapping.t2d, "fc.weight": torch.zeros(2, 2)},
              str(runs / "step_0000003" / MODEL_FILE))
    (runs / "step_0000006").mkdir()
    (runs / "step_0000006" / MODEL_FILE).write_bytes((runs / "step_0000003" / MODEL_FILE).read_bytes()[:40])
    got = checkpoint_vocab(tmp_path, 4)
    assert got is not None and torch.equal(got.d2t, mapping.d2t) and torch.equal(got.t2d, mapping.t2d)
    assert checkpoint_vocab(tmp_path, 5) is None  # another draft size: not this run's to resume


def test_the_served_cli_refuses_prompts_with_no_room_before_any_engine_starts(tmp_path, monkeypatch):
    """`python -m training.served` started its engines for prompts vLLM then refused (or had none to measure)."""
    from training import served

    monkeypatch.setattr(served, "served_vs_simulated", lambda *a, **k: pytest.fail("the vLLM engine was started"))
    (tmp_path / "p.json").write_text(f"[[1, 2], {[5] * 64}]")
    with pytest.raises(SystemExit, match=r"prompt 2 has 64 tokens: it needs --max-model-len 65 or more \(got 64\)"):
        served.main(["--target", "t", "--draft", "d", "--prompts", str(tmp_path / "p.json"), "--max-model-len", "64"])
    assert served.unservable([], 64) == "no prompts to measure"  # --text on an empty file
    assert served.unservable([[1] * 63], 64) is None
