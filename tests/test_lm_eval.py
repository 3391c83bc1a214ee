"""lm-evaluation-harness against a running ironlm server, with transformers as the reference.

- The local multiple-choice task tests/lm_eval_tasks/tiny_mc.yaml (lm-eval's json loader, no hub download) run with
  `local-completions` (echo=True, logprobs=1, max_tokens=1 over token ids: the prompt logprobs) against the server,
  and with lm-eval's own `hf` model on the same tiny model (fp32, CPU): every choice's log-likelihood within 1e-4
  relative, the same is_greedy flags, the same accuracy.
- The generate-until task tiny_gen.yaml with `local-chat-completions`: every greedy answer equal to transformers'
  greedy generate over the chat template's tokens, cut where lm-eval cuts it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Before lm_eval imports datasets / huggingface_hub: everything here is local.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval
import pytest
import torch
import yaml
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, AutoTokenizer

from ironlm import EngineConfig, LLMEngine
from ironlm.server.api import build_app
from server_utils import TINY_ENGINE_KW, AsyncLLMEngine, LiveServer, tiny_model_path

TASKS = Path(__file__).parent / "lm_eval_tasks"
RTOL = 1e-4


def task(name: str) -> dict[str, Any]:
    """A task YAML of tests/lm_eval_tasks with its data file made absolute (the YAML's is relative to the repo)."""
    config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(TASKS / f"{name}.jsonl")
    return config


def evaluate(model: str, model_args: dict[str, Any], config: dict[str, Any], **kw: Any) -> tuple[dict, list[dict]]:
    """(the task's metrics, its per-item samples in doc order)."""
    # The tasks are config dicts: indexing lm-eval's thousands of built-in task YAMLs (~14 s a call on 2 cores)
    # would find nothing they use.
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[config], log_samples=True,
                                  task_manager=TaskManager(include_defaults=False), bootstrap_iters=0, **kw)
    assert out is not None
    name = config["task"]
    return out["results"][name], sorted(out["samples"][name], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def server(path: Path) -> Any:
    kw: dict[str, Any] = dict(TINY_ENGINE_KW)
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", **kw)))
    live = LiveServer(build_app(engine, served_model_name="tiny"), engine)
    yield live
    live.stop()


def test_multiple_choice_local_completions_equals_hf(server: LiveServer, path: Path):
    config = task("tiny_mc")
    # BOS on both sides: lm-eval's hf model prepends it as this tokenizer does; the API model is told so.
    api, api_samples = evaluate("local-completions", {
        "model": "tiny", "base_url": f"{server.base_url}/completions", "tokenizer": str(path),
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 4, "max_length": 256,
        "add_bos_token": True}, config)
    hf, hf_samples = evaluate("hf", {"pretrained": str(path), "dtype": "float32", "device": "cpu",
                                     "add_bos_token": True}, config, batch_size=4)
    n_docs = len((TASKS / "tiny_mc.jsonl").read_text().splitlines())
    assert len(api_samples) == len(hf_samples) == n_docs
    worst = 0.0
    for a, h in zip(api_samples, hf_samples):
        assert a["doc_id"] == h["doc_id"] and a["arguments"] == h["arguments"]
        assert len(a["filtered_resps"]) == len(a["doc"]["choices"])
        for (ll_a, greedy_a), (ll_h, greedy_h) in zip(a["filtered_resps"], h["filtered_resps"]):
            worst = max(worst, abs(ll_a - ll_h) / abs(ll_h))
            assert greedy_a == greedy_h
        assert (a["acc"], a["acc_norm"]) == (h["acc"], h["acc_norm"])
    assert worst <= RTOL, worst
    assert api["acc,none"] == hf["acc,none"] and api["acc_norm,none"] == hf["acc_norm,none"]


def test_generate_until_local_chat_completions_equals_transformers(server: LiveServer, path: Path):
    config = task("tiny_gen")
    result, samples = evaluate("local-chat-completions", {
        "model": "tiny", "base_url": f"{server.base_url}/chat/completions"}, config, apply_chat_template=True)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    docs = [json.loads(line) for line in (TASKS / "tiny_gen.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs)
    gen = config["generation_kwargs"]
    matches = []
    for doc, sample in zip(docs, samples):
        ids = tok.apply_chat_template([{"role": "user", "content": doc["prompt"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=gen["max_gen_toks"], do_sample=False)
        want = tok.decode(out[0, len(ids):], skip_special_tokens=True).split(gen["until"][0])[0]
        assert sample["filtered_resps"] == [want], doc
        matches.append(float(want == doc["target"]))
    assert result["exact_match,none"] == sum(matches) / len(matches)
