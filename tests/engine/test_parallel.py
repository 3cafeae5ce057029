"""Tensor / expert parallelism on the CPU (gloo): a sharded engine equals the one-process engine (contract 9).

Each case builds a tiny model of a family (transformers, saved as a checkpoint), three adapters with LoRA on
attention, the dense / shared-expert MLPs, the router and the routed experts, one in each PEFT expert layout
(per-expert keys, `target_parameters`, packed 3D: each rank reads its slices of each), and compares the fp32 logits of
one batch mixing the three adapters and base rows, and greedy generation, between `LLM(...)` on one process
and `LLM(..., tensor_parallel_size=N[, expert_parallel=True])` (spawned gloo workers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.errors import ConfigError, WorkerError
from tests.helpers.oracle import tiny_hf_model
from tests.helpers.oracle_lora import build_peft_adapter, per_expert_lora, write_packed, write_per_expert

ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, max_loras=3, max_num_batched_tokens=256,
              num_kv_blocks=64, max_model_len=64)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (model dir, adapters), built once per family."""
    cache = {}

    def get(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            hf = tiny_hf_model(family, seed=5, **OVERRIDES.get(family, {}))
            hf.save_pretrained(str(root / "model"))
            adapters = {
                "a": write_per_expert(per_expert_lora(hf, seed=1, r=4, lora_alpha=8), root / "a"),
                "b": build_peft_adapter(hf, root / "b", seed=2, r=3, lora_alpha=5),  # target_parameters experts
                "c": write_packed(per_expert_lora(hf, seed=3, r=2, lora_alpha=4, use_rslora=True), root / "c"),
            }
            cache[family] = (root / "model", adapters, hf.config.vocab_size)
        return cache[family]
    return get


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    names = ["a", None, "b", "c", "a", None, "c"]
    seqs = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(2, 13, (len(names),), generator=g)]
    return seqs, names


def _run(model_dir, adapters, vocab, **parallel):
    llm = LLM(model_dir, adapters, **ENGINE, **parallel)
    try:
        seqs, names = _batch(vocab)
        logits = llm.logits(seqs, names)
        if not parallel:  # the adapters change their rows: a sharding that lost LoRA would show
            base = llm.logits(seqs, [None] * len(seqs))
            assert all((lg - bs).abs().max() > 1e-2 for lg, bs, n in zip(logits, base, names, strict=True) if n)
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate(seqs[:4], greedy, names[:4])
        return logits, [o.token_ids for o in outs]
    finally:
        llm.engine.close()


# DeepSeek-V2's tiny model has 3 heads (an unsplittable case below); 4 here
# 8 experts (the tiny models' 6 do not partition over 4 ranks: EP at TP=4); Qwen2-MoE keeps its unsplittable 5
OVERRIDES = {"deepseek_v2": dict(num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4),
             "glm4_moe": dict(n_routed_experts=8), "olmoe": dict(num_experts=8), "qwen3_moe": dict(num_experts=8),
             "minimax_m2": dict(num_local_experts=8), "dots1": dict(n_routed_experts=8)}
TP2, EP2 = dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel=True)
TP4 = dict(tensor_parallel_size=4)
TP4_EP = dict(tensor_parallel_size=4, expert_parallel=True)
# overlapped scheduling (the CUDA default): the ids of unread tokens reach the workers by a device broadcast
CORE = [("qwen3_moe", TP2), ("qwen3_moe", dict(EP2, async_scheduling=True)), ("qwen2_moe", TP2), ("mixtral", EP2),
        ("olmoe", TP2), ("deepseek_v2", TP2), ("deepseek_v3", EP2), ("glm4_moe", TP2), ("minimax_m2", TP2)]
# every family at TP=2, TP=4 and EP (over 2 ranks, attention TP=2); Qwen2-MoE's 5 experts cannot be partitioned
# (test_unsplittable_shapes_raise_config_error). The one-process reference runs once per family (`reference`).
SLOW = [("qwen3_moe", TP4), ("mixtral", TP2), ("olmoe", EP2), ("deepseek_v3", TP2), ("deepseek_v3", TP4),
        ("glm4_moe", EP2), ("deepseek_v2", EP2), ("mixtral", TP4_EP), ("deepseek_v3", TP4_EP), ("glm4_moe", TP4_EP),
        ("olmoe", TP4_EP), ("qwen3_moe", TP4_EP), ("deepseek_v2", TP4_EP),
        ("qwen2_moe", TP4), ("mixtral", TP4), ("olmoe", TP4), ("deepseek_v2", TP4), ("glm4_moe", TP4),
        ("minimax_m2", EP2), ("minimax_m2", TP4_EP), ("glm4_moe_lite", TP2), ("glm4_moe_lite", EP2),
        ("dots1", TP2), ("dots1", EP2)]
CASES = CORE + [pytest.param(f, p, marks=pytest.mark.slow) for f, p in SLOW]


def _case_id(family, parallel):
    return (f"{family}-tp{parallel['tensor_parallel_size']}{'-ep' if parallel.get('expert_parallel') else ''}"
            f"{'-overlapped' if parallel.get('async_scheduling') else ''}")


@pytest.fixture(scope="module")
def reference(built):
    """family -> the one-process engine's (logits, greedy tokens), run once per family for all its cases."""
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = _run(*built(family))
        return cache[family]
    return get


@pytest.mark.parametrize("family,parallel", CASES, ids=[_case_id(*c) for c in CORE + SLOW])
def test_sharded_engine_equals_one_process(built, reference, family, parallel):
    model_dir, adapters, vocab = built(family)
    ref_logits, ref_tokens = reference(family)
    got_logits, got_tokens = _run(model_dir, adapters, vocab, **parallel)
    for ref, got in zip(ref_logits, got_logits, strict=True):
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-4, f"{family} {parallel}: max |diff| {diff:.2e}"

    assert got_tokens == ref_tokens


def test_hf_overrides_reach_every_rank(built):
    """YaRN given by hf_overrides (not in config.json) at TP=2: each rank reads the model with the overrides, so
    the sharded engine equals one process with them, and both differ from the file's own rotary. ENGINE's 64
    positions stay below the tiny model's 128: only the YaRN frequencies change the logits."""
    model_dir, adapters, vocab = built("qwen3_moe")
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}
    ref_logits, ref_tokens = _run(model_dir, adapters, vocab, hf_overrides=yarn)
    got_logits, got_tokens = _run(model_dir, adapters, vocab, hf_overrides=yarn, **TP2)
    plain_logits, _ = _run(model_dir, adapters, vocab)
    assert max((g - r).abs().max().item() for g, r in zip(got_logits, ref_logits, strict=True)) <= 1e-4
    assert got_tokens == ref_tokens
    assert max((p - r).abs().max().item() for p, r in zip(plain_logits, ref_logits, strict=True)) > 1e-3


@pytest.mark.parametrize("family,parallel,needle", [
    ("deepseek_v2", TP2, "num_attention_heads=3"),  # the tiny model's own 3 heads
    ("qwen2_moe", EP2, "num_experts=5"),
    ("qwen3_moe", dict(tensor_parallel_size=3), "num_attention_heads=4"),
])
def test_unsplittable_shapes_raise_config_error(tmp_path, family, parallel, needle):
    hf = tiny_hf_model(family, seed=0)
    hf.save_pretrained(str(tmp_path / "model"))
    with pytest.raises(ConfigError, match=needle):
        LLM(tmp_path / "model", **ENGINE, **parallel)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_worker_raises_worker_error_and_leaves_no_process(built):
    model_dir, adapters, vocab = built("qwen3_moe")
    llm = LLM(model_dir, adapters, **ENGINE, **TP2, parallel_step_timeout_s=20)
    pids = [p.pid for p in llm.engine.driver.procs]
    assert pids and all(_alive(p) for p in pids)
    seqs, names = _batch(vocab)
    llm.logits(seqs[:2], names[:2])  # the group works
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        llm.generate(seqs[:2], SamplingParams(max_tokens=3), names[:2])
    assert time.monotonic() - start < 20
    with pytest.raises(WorkerError):  # the engine stays failed, quickly
        llm.logits(seqs[:1], names[:1])
    llm.engine.close()
    assert not any(_alive(p) for p in pids)


def test_adapter_load_failing_on_a_worker_fails_everywhere(built, tmp_path):
    model_dir, adapters, vocab = built("qwen3_moe")
    llm = LLM(model_dir, {}, **ENGINE, **TP2)
    try:
        with pytest.raises(Exception, match="missing"):
            llm.add_adapter("x", tmp_path / "missing")
        assert llm.adapters == []
        llm.add_adapter("a", adapters["a"])  # run time, reaches every rank
        seqs, _ = _batch(vocab)
        with_a = llm.logits(seqs[:2], ["a", None])
        llm.remove_adapter("a")
        llm.add_adapter("a", adapters["b"])  # the name now means another adapter on every rank
        with_b = llm.logits(seqs[:2], ["a", None])
        assert (with_a[0] - with_b[0]).abs().max() > 1e-2
        assert (with_a[1] - with_b[1]).abs().max() <= 1e-5
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_hung_worker_raises_worker_error_after_the_step_timeout(built):
    model_dir, adapters, vocab = built("qwen3_moe")
    llm = LLM(model_dir, adapters, **ENGINE, **TP2, parallel_step_timeout_s=4)
    procs = llm.engine.driver.procs
    _stopped_rank_fails_the_step(llm, procs[0].pid, vocab, 4)
    assert not any(p.is_alive() for p in procs)


def _stopped_rank_fails_the_step(llm, pid: int, vocab: int, step_timeout_s: float, resume: bool = False) -> None:
    """Rank `pid` stopped (SIGSTOP: alive, never answers): the next step raises WorkerError within three step
    timeouts; the engine is closed after (and the rank let run again, with `resume`)."""
    seqs, names = _batch(vocab)
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerError):
            llm.logits(seqs[:2], names[:2])
        assert time.monotonic() - start < step_timeout_s * 3
    finally:
        llm.engine.close()
        if resume:
            os.kill(pid, signal.SIGCONT)


# ------------------------------------------------------------------ several hosts, simulated on this one ---


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _headless_node(port: int, log) -> subprocess.Popen:
    """Node 1 of 2: `moelora serve --headless` in its own process, as on a second host."""
    return subprocess.Popen([sys.executable, "-m", "moelora.cli", "serve", "--headless", "--nnodes", "2",
                             "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _two_node_llm(built, tmp_path, step_timeout_s: float):
    """A TP=2 engine over two "hosts": rank 0 here, rank 1 in a headless node process; yields (llm, node, the
    node's descendants, vocab). The node is killed on the way out whatever happened."""
    model_dir, adapters, vocab = built("qwen3_moe")
    port = _free_port()
    with open(tmp_path / "node1.log", "w") as log:
        node = _headless_node(port, log)
        try:
            llm = LLM(model_dir, adapters, **ENGINE, **TP2, nnodes=2, master_port=port,
                      parallel_step_timeout_s=step_timeout_s)
            yield llm, node, _descendants(node.pid), vocab
        finally:
            node.kill()
            node.wait()


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().split(")")[-1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                pass
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        out += kids
        todo += kids
    return out


def _all_gone(pids: list[int], within_s: float = 10) -> bool:
    """Whether every process of `pids` is gone within `within_s` (a node's children are joined before it exits, but
    multiprocessing's resource tracker leaves a moment after its node)."""
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


@pytest.mark.parametrize("parallel", [EP2, pytest.param(TP4, marks=pytest.mark.slow)], ids=["ep2", "tp4"])
def test_two_nodes_equal_one_process(built, reference, tmp_path, parallel):
    """Node 0 (this process: the scheduler and rank 0; at TP=4 also a forked local rank 1, on a pipe) and node 1
    (a headless node process holding the other ranks, on TCP), joined as on two hosts; the engine equals one
    process, and the node exits cleanly when the engine closes."""
    model_dir, adapters, vocab = built("qwen3_moe")
    port = _free_port()
    with open(tmp_path / "node1.log", "w") as log:
        node = _headless_node(port, log)
        try:
            logits, tokens = _run(model_dir, adapters, vocab, **parallel, nnodes=2, master_port=port,
                                  parallel_step_timeout_s=60)
            assert node.wait(30) == 0, (tmp_path / "node1.log").read_text()
        finally:
            node.kill()
            node.wait()
    ref_logits, ref_tokens = reference("qwen3_moe")
    for ref, got in zip(ref_logits, logits, strict=True):
        assert (got - ref).abs().max().item() <= 1e-4
    assert tokens == ref_tokens


def test_killed_remote_worker_raises_worker_error_and_leaves_no_process(built, tmp_path):
    with _two_node_llm(built, tmp_path, 20) as (llm, node, children, vocab):
        remote = llm.engine.driver.procs[0].pid  # rank 1, reported by its node
        assert remote in children and _alive(remote)
        seqs, names = _batch(vocab)
        llm.logits(seqs[:2], names[:2])
        os.kill(remote, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1"):
            llm.generate(seqs[:2], SamplingParams(max_tokens=3), names[:2])
        assert time.monotonic() - start < 20
        llm.engine.close()
        assert node.wait(30) == 1  # the node saw its rank die and stopped
        assert _all_gone(children)


@pytest.mark.slow
def test_hung_remote_worker_raises_worker_error_after_the_step_timeout(built, tmp_path):
    """A remote rank that stops answering (SIGSTOP) fails the step within the timeout; once it runs again it finds
    its connection closed and exits, and so does its node."""
    with _two_node_llm(built, tmp_path, 4) as (llm, node, children, vocab):
        _stopped_rank_fails_the_step(llm, llm.engine.driver.procs[0].pid, vocab, 4, resume=True)
        node.wait(30)
        assert _all_gone(children)
