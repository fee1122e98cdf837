"""The extraction's quarantine reasons say what happened."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from pipeline.hidden.extract import VLLMStateCapture


def _engine_capture(token_ids: list[int], n_states: int) -> str | None:
    """The quarantine reason ``VLLMStateCapture`` gives one 3-token sample whose engine file holds
    ``n_states`` states for ``token_ids`` (no engine: its call and the connector's reader are stubbed)."""
    conn = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector")
    cap = object.__new__(VLLMStateCapture)
    cap.max_model_len, cap.lm_head, cap.norm_weight, cap.eps, cap.device = 65, None, torch.ones(4), 1e-6, "cpu"
    done = SimpleNamespace(kv_transfer_params={"hidden_states_path": "x"})
    cap.llm = SimpleNamespace(generate=lambda prompts, params, use_tqdm: [done])
    data = {"hidden_states": torch.zeros(n_states, 4, 4), "token_ids": torch.tensor(token_ids)}
    with mock.patch.object(conn, "load_hidden_states", lambda path: data), \
            mock.patch.object(conn, "cleanup_hidden_states", lambda path: None):
        (c,) = cap([[5, 6, 7]], [[0]])
    return c.error


def test_vllm_states_of_other_token_ids_are_not_called_a_shape_error():
    """As many states as tokens, but for other ids: the reason said "shape: ... for 3 tokens, expected 3"."""
    reason = _engine_capture([5, 6, 9], 3)
    assert reason is not None and not reason.startswith("shape:") and "other token ids" in reason
    assert _engine_capture([5, 6], 2) == "shape: vLLM states for 2 tokens, expected 3"
