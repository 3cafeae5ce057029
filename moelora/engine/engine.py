"""`LLMEngine`: requests in, tokens out, one `step()` at a time, on any device.

The same scheduler, paged KV cache and adapter pool run on the CPU (torch kernels) and on CUDA
(Triton kernels). A step: schedule -> put the step's adapters in device slots -> build inputs
once -> run the model -> sample -> append tokens, apply stop rules, publish full KV blocks to
the prefix cache, free finished requests' blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moelora.engine import scoring
from moelora.engine.config import EngineConfig
from moelora.engine.cuda_graphs import CudaGraphRunner
from moelora.engine.detokenize import StopStrings, first_stop
from moelora.engine.kv_cache import PagedKVCache
from moelora.engine.piecewise_graphs import PiecewiseGraphs, piecewise_tokens
from moelora.engine.readback import ReadBack
from moelora.engine.request import Request, SamplingParams
from moelora.engine.runner import ModelRunner, lora_needs
from moelora.engine.sampler import (
    PenaltyState,
    adjust_logits,
    logprobs_on_device,
    logprobs_to_host,
    record_tokens,
    sample,
)
from moelora.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from moelora.engine.structured import Grammars, mask_rows
from moelora.engine.tokenizer import Tokenizer
from moelora.errors import AdapterError, ConfigError, RequestError
from moelora.layers.mla import MLAttention
from moelora.lora.adapter import LoRAAdapter
from moelora.lora.pool import AdapterPool
from moelora.models.lora_targets import lora_site_owners, site_kinds

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step whose forward and sampling are enqueued on the device but not read back (overlapped
    scheduling): `tokens[i]` (on the device, for the next step's inputs) is the token of `reqs[i]`;
    `host` their copies on their way to the host (tokens, then the logprob tensors)."""

    step: ScheduledStep
    reqs: list[Request]
    tokens: torch.Tensor | None
    logprob_rows: tuple | None  # (wants, rows) of `logprobs_on_device`, or None when no request asked
    host: ReadBack | None


def check_layer_options(model, cfg: EngineConfig) -> None:
    """ConfigError unless `model` was built with the layer options `cfg` gives it (options reach a layer
    through its constructor: an engine cannot change them), naming the ones that differ."""
    want = cfg.layer_options(model.options)
    if model.options != want:
        diff = [f"{f}={getattr(model.options, f)!r} (the config's: {getattr(want, f)!r})"
                for f in want.__dataclass_fields__ if getattr(model.options, f) != getattr(want, f)]
        raise ConfigError(f"the model was built with other layer options than this engine's config asks for: "
                          f"{', '.join(diff)}; build it with options=cfg.layer_options(), or pass "
                          "model.with_options(cfg.layer_options(model.options))")


class LLMEngine:
    def __init__(self, model, tokenizer: Tokenizer | None, cfg: EngineConfig, load_adapter,
                 adapters: Mapping[str, str | Path] | None = None):
        """`load_adapter(name, path)` -> LoRAAdapter; `adapters` (name -> path) are registered before the
        decode graphs are captured (so they are captured with those adapters' LoRA sites on)."""
        check_layer_options(model, cfg)
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.model_config = model.config
        self.device = cfg.torch_device
        self._site_owners = lora_site_owners(model)
        self.pool = self._adapter_pool(cfg, self._loader(load_adapter))
        self.cache = PagedKVCache(model.kv_cache_shapes(), cfg.num_kv_blocks, cfg.block_size, self.device,
                                  cfg.torch_dtype)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_loras,
                                                   cfg.enable_prefix_caching, cfg.scheduling_policy),
                                   self.cache.allocator,
                                   adapter_ready=self.pool.ensure if cfg.async_adapter_loading else None)
        needs = lora_needs(cfg, model)  # what every step's LoRABatch carries, eager or in a graph
        self.runner = self._make_runner(model, needs=needs)
        self._registered_rank = 0  # the largest rank of any adapter registered so far (the graphs' LoRA width)
        # LoRA sites no registered adapter has weights at (all of them until one is added): skipped
        self.runner.lora_idle = frozenset(self._site_owners.values()) if cfg.skip_idle_lora_sites else frozenset()
        for name, path in (adapters or {}).items():
            self.pool.add(name, path)
        self.graphs = self.pieces = None
        # MLA's expanded decode loops over sequences on the host: graphs need the absorbed form
        graph_safe = cfg.mla_absorbed_decode or not any(isinstance(m, MLAttention) for m in model.modules())
        if cfg.use_cuda_graphs and graph_safe and getattr(model, "supports_cuda_graphs", False):
            pad = self.cache.allocator.reserve()  # padding rows of a graph bucket write here: in no request's use
            self.graphs = self._make_graphs(model, self.cache, cfg.max_num_seqs, cfg.max_model_len, pad,
                                            needs, cfg.base_decode_graphs,
                                            frozenset(self._site_owners.values()))
            self.graphs.capture(self.lora_idle, self._graph_width)
            tokens = piecewise_tokens(cfg)
            if tokens:
                self.pieces = PiecewiseGraphs(model, self.cache, tokens, pad, needs)
                self.pieces.capture(self.lora_idle, self._graph_width)
        self.requests: dict[str, Request] = {}
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos = eos
        self._counter = 0
        self._launched: _Launched | None = None  # overlapped scheduling: the step in flight
        # requests a step read back outside `step()` changed (`prompt_logits` settles the step in flight);
        # the next `step()` reports them, so a caller delivering step() results never misses a token or a finish
        self._settled: list[Request] = []
        self._grammar_set: Grammars | None = None  # structured outputs' compiler, made at first use
        self._grammar_lock = threading.Lock()

    @property
    def lora_idle(self) -> frozenset:
        """The LoRA modules no registered adapter has weights at (`LoRABatch.idle`, carried by the runner)."""
        return self.runner.lora_idle

    def _loader(self, load_adapter):
        """`load_adapter` as the pool calls it, when an adapter is added (and on a reload after the CPU
        cache dropped it): it refuses LoRA on a module that has no site here (left out by
        lora_target_modules) instead of failing at its first slot write, and turns the adapter's
        sites on. Decode graphs follow at their next run, or at `capture_graphs()`."""
        sites = set(self.model.lora_sites())
        targets = self.cfg.lora_target_modules or ()
        engine = weakref.ref(self)  # the pool holds this loader: no cycle, so a dropped engine frees at once

        def load(name: str, path):
            adapter = load_adapter(name, path)
            outside = set(adapter.sites) - sites
            if outside:
                raise AdapterError(f"adapter {name!r} has LoRA on {', '.join(site_kinds(outside))}, which this "
                                   f"engine has no LoRA site for (lora_target_modules: "
                                   f"{', '.join(site_kinds(targets))}); start it with those modules targeted")
            engine()._turn_on(adapter)
            return adapter
        return load

    @property
    def _graph_width(self) -> int | None:
        """The LoRA width decode graphs are captured at: the registered adapters' largest rank, or None
        (max_lora_rank) when `lora_width_by_batch` is off."""
        return self._registered_rank if self.cfg.lora_width_by_batch else None

    def capture_graphs(self) -> None:
        """Re-capture the decode graphs and the piecewise graphs now if the idle LoRA sites changed since their
        capture, or a registered adapter is wider than their LoRA width (so the first request after adding
        adapters at run time does not pay for it)."""
        for g in (self.graphs, self.pieces):
            if g is not None and (g.lora_idle != self.lora_idle or not g.holds(self._graph_width)):
                g.capture(self.lora_idle, self._graph_width)

    def _turn_on(self, adapter: LoRAAdapter) -> None:
        """Every site `adapter` has LoRA at is no longer idle (monotone: the next LoRA batch carries the
        smaller set); the graphs' LoRA width grows to its rank if it is wider."""
        self._registered_rank = max(self._registered_rank, adapter.max_rank)
        idle = self.runner.lora_idle
        if idle:
            self.runner.lora_idle = idle - {self._site_owners[key] for key, w in adapter.sites.items() if w.rank > 0}

    def _make_runner(self, model, **kw) -> ModelRunner:
        """The step runner (a tensor-parallel engine's also sends each step to its workers)."""
        return ModelRunner(model, self.cache, self.device, **kw)

    def _make_graphs(self, *args) -> CudaGraphRunner:
        """The decode-graph runner (a tensor-parallel engine's also drives its workers' graphs)."""
        return CudaGraphRunner(*args)

    def close(self) -> None:
        """Release what outlives the engine object (a tensor-parallel engine's workers); nothing here."""

    def _adapter_pool(self, cfg: EngineConfig, load_adapter) -> AdapterPool:
        """Slot writes through a side stream on CUDA when `async_adapter_loading` (adapters staged once
        in each site's slot dtype and page-locked, so the copies are asynchronous); synchronous otherwise."""
        if not (cfg.async_adapter_loading and self.device.type == "cuda"):
            return self._new_pool(cfg.max_loras, cfg.max_cpu_loras, load_adapter, self.model.set_lora_slot)
        from moelora.engine.adapter_loads import SideStreamLoads

        dtypes = self.model.lora_site_dtypes()
        return self._new_pool(cfg.max_loras, cfg.max_cpu_loras, load_adapter, self.model.set_lora_slot,
                              loads=SideStreamLoads(self.device),
                              stage=lambda adapter: adapter.staged(dtypes, pin=True))

    def _new_pool(self, *args, **kw) -> AdapterPool:
        """The adapter pool (a tensor-parallel engine's also writes every worker's slots)."""
        return AdapterPool(*args, **kw)

    # requests -----------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, adapter: str | None = None,
                    request_id: str | None = None, cache_salt: str | None = None, priority: int = 0) -> Request:
        """`cache_salt` (vLLM's): the request's prefix-cache blocks are its salt's, shared only with requests of the
        same salt (and adapter): tenants who cannot tell, by timing, what another one's prompts held. `priority`
        (vLLM's; lower first): read under `scheduling_policy` "priority", refused otherwise unless 0."""
        if priority != 0 and self.cfg.scheduling_policy != "priority":
            raise RequestError(f"priority {priority} needs the priority scheduling policy "
                               "(--scheduling-policy priority); this engine schedules first come, first served")
        if adapter is not None and adapter not in self.pool.names:
            raise RequestError(f"unknown adapter {adapter!r}; loaded: {self.pool.names}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.cfg.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; max_model_len is {self.cfg.max_model_len} "
                               "(prompt plus at least one generated token)")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {self.model_config.vocab_size})")
        if params.logprobs is not None and params.logprobs > self.model_config.vocab_size:
            raise RequestError(f"logprobs {params.logprobs} is more than the vocabulary "
                               f"(size {self.model_config.vocab_size})")
        if params.bad_words:  # vLLM's strings: tokenized here, once
            if self.tokenizer is None:
                raise RequestError("bad_words need the model's tokenizer.json (or give bad_words_ids)")
            words = self.tokenizer.word_ids(params.bad_words)
            params = dataclasses.replace(params, bad_words=(), bad_words_ids=(*params.bad_words_ids, *words))
        V = self.model_config.vocab_size
        for name, tokens in (("logit_bias", [t for t, _ in params.logit_bias]),
                             ("allowed_token_ids", params.allowed_token_ids or ()),
                             ("bad_words", [t for w in params.bad_words_ids for t in w])):
            bad = [t for t in tokens if t >= V]
            if bad:
                raise RequestError(f"{name} token id {bad[0]} is outside the vocabulary (size {V})")
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in flight")
        matcher = self.grammars().matcher(params.structured) if params.structured is not None else None
        gen = torch.Generator(self.device).manual_seed(params.seed) if params.seed is not None else None
        req = Request(request_id, ids, params, adapter, prompt if isinstance(prompt, str) else None,
                      arrival=time.monotonic(), generator=gen, cache_key=self.pool.cache_key(adapter))
        if cache_salt is not None:
            req.cache_key = (req.cache_key, cache_salt)
        req.priority = priority
        req.matcher, req.grammar_on = matcher, matcher is not None and params.structured.after is None
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def grammars(self) -> Grammars:
        """The structured-output compiler over this engine's tokenizer (made at the first call; any thread)."""
        if self.tokenizer is None:
            raise RequestError("structured outputs need the model's tokenizer.json")
        with self._grammar_lock:
            if self._grammar_set is None:
                self._grammar_set = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos,
                                             any_whitespace=self.cfg.structured_any_whitespace)
        return self._grammar_set

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")
            req.penalty = None

    def check_blocks(self) -> None:
        """Invariant (tests): the KV blocks in use are exactly those the live requests (waiting, running,
        held) hold, refcounts included; a finished request holds none, and every unfinished request the
        engine knows is live in the scheduler. AssertionError otherwise."""
        s = self.scheduler
        live = [*s.waiting, *s.running, *s.held]
        assert not any(r.finished for r in live), "a finished request is still scheduled"
        assert {id(r) for r in self.requests.values() if not r.finished} <= {id(r) for r in live}, \
            "an unfinished request is in no scheduler queue"
        launched = self._launched.step.requests if self._launched is not None else []
        for r in [*self.requests.values(), *launched, *self._settled]:
            assert not (r.finished and r.block_ids), f"finished request {r.request_id} holds blocks {r.block_ids}"
        self.cache.allocator.check(Counter(b for r in live for b in r.block_ids))

    def has_unfinished(self) -> bool:
        """Requests wait, run, or have a token in flight (a step in flight whose requests all
        stopped or were aborted holds nothing anyone waits for: the next step drops it)."""
        launched = self._launched
        return (self.scheduler.has_work() or bool(self._settled)
                or (launched is not None and any(not r.finished for r in launched.reqs)))

    # stepping -----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a token or finished in it (with
        `async_scheduling`, those of the step launched by the previous call), after those of a step read
        back since the last call by `prompt_logits`."""
        settled, self._settled = self._settled, []
        if self.cfg.async_scheduling:
            changed = self._step_overlapped()
        elif not self.scheduler.has_work():
            changed = []
        else:
            step = self.scheduler.schedule()
            changed = self._read_back(self._launch(step, None)) if step.requests else []
        return settled + changed  # after a settle no step was in flight: nothing comes out twice

    def _step_overlapped(self) -> list[Request]:
        """Schedule and launch step n+1 while step n runs on the device, then read step n back.
        Step n+1 takes the tokens step n sampled straight from the device (runner `pending`), so the
        host never waits for the device before launching; stop rules see a token one step later, and
        a row computed for a request that stopped in step n is dropped. Everything runs on one
        stream, so step n+1's cache writes and slot changes land after step n's reads.
        A step with a request that reads its own output to sample (a grammar, a bad word of several tokens)
        launches its forward, reads step n back (its tokens advance the grammars), then samples: the host's
        mask work runs while the forward does, and the mask sees every earlier token."""
        prev, self._launched = self._launched, None
        if self.scheduler.has_work():
            pending = (prev.tokens, {r: i for i, r in enumerate(prev.reqs)}) if prev and prev.reqs else None
            step = self.scheduler.schedule()
            if step.requests and any(r.params.reads_its_output for r in step.requests):
                forward = self._forward(step, pending)
                changed = self._read_back(prev) if prev is not None else []
                self._launched = self._sample_step(*forward)
                return changed
            if step.requests:
                self._launched = self._launch(step, pending)
        return self._read_back(prev) if prev is not None else []

    def _launch(self, step: ScheduledStep, pending) -> _Launched:
        """Run the model and sample on the device; no host sync (the synchronous step reads it back
        at once, the overlapped one a step later)."""
        return self._sample_step(*self._forward(step, pending))

    def _forward(self, step: ScheduledStep, pending) -> tuple[ScheduledStep, list[Request], torch.Tensor]:
        """Enqueue the step's forward: (step, the requests it samples, their logits)."""
        slot_of = self.pool.acquire(r.adapter for r in step.requests)
        inputs = self.runner.prepare(step, slot_of, self.pool.slot_ranks, pending)
        decode_only = len(inputs.sample_index) == len(step.requests) == step.num_tokens
        if self.graphs is not None and decode_only and self.graphs.can_run(len(step.requests)):
            logits = self.graphs.run(inputs)
        elif self.pieces is not None and self.pieces.can_run(step.num_tokens):
            logits = self.pieces.run(inputs)
        else:
            logits = self.runner.run(inputs)
        for req, n in zip(step.requests, step.num_new, strict=True):
            req.num_computed += n
        return step, [step.requests[i] for i in inputs.sample_index], logits

    def _sample_step(self, step: ScheduledStep, reqs: list[Request], logits: torch.Tensor) -> _Launched:
        """Enqueue the sampling of the step's forward and the copies of its tokens to the host. A request
        finished meanwhile (its last token read back after the forward was launched) is sampled plainly and
        its row dropped when read."""
        tokens = logprobs = None
        if reqs:
            tokens = self._sample(logits, reqs)
            wants = [r.params.logprobs for r in reqs]
            if any(w is not None for w in wants):  # computed now: a graph's logits buffer is reused
                logprobs = logprobs_on_device(logits, tokens, wants)
        for req in reqs:
            if req.finished:
                continue
            req.num_pending += 1
            known_after = len(req.output_ids) + req.num_pending
            if known_after >= req.params.max_tokens or len(req.prompt_ids) + known_after >= self.cfg.max_model_len:
                self.scheduler.hold(req)  # finishes by length when read: schedule it no more
        # queued behind this step's sampling, so reading it back never waits for a step launched later
        host = ReadBack([tokens, *(logprobs[2:] if logprobs else ())]) if reqs else None
        return _Launched(step, reqs, tokens, logprobs[:2] if logprobs else None, host)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Token ids [len(reqs)] on the device. Requests with logit adjustments sample from adjusted
        logits; penalized ones count their token (their state is created at their first draw)."""
        rows = [i for i, r in enumerate(reqs) if r.params.adjusts_logits and not r.finished]
        if not rows:
            return sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        states, suppress = [], []
        for i in rows:
            r, p = reqs[i], reqs[i].params
            if p.penalized and r.penalty is None:
                r.penalty = PenaltyState.new(r.all_ids, logits.shape[1], logits.device)
            states.append(r.penalty)
            # no stop token before min_tokens (a grammar decides where a constrained output ends)
            early = len(r.output_ids) + r.num_pending < p.min_tokens and not r.grammar_on
            suppress.append((*p.stop_token_ids, *(() if p.ignore_eos else sorted(self.eos))) if early else ())
        scores = adjust_logits(logits, rows, [reqs[i].params for i in rows], states, suppress,
                               [reqs[i].output_ids for i in rows])
        held = [i for i in rows if reqs[i].grammar_on]
        if held:
            json_rows = [j for j, i in enumerate(held) if reqs[i].params.structured.is_json]
            scores = mask_rows(scores, held, self._grammar_set.allowed([reqs[i].matcher for i in held],
                                                                        scores.device, json_rows))
        tokens = sample(scores, [r.params for r in reqs], [r.generator for r in reqs])
        pen = [j for j, i in enumerate(rows) if reqs[i].params.penalized]
        if pen:
            record_tokens(tokens, [rows[j] for j in pen], [states[j] for j in pen])
        return tokens

    def _read_back(self, launched: _Launched) -> list[Request]:
        changed = []
        if launched.reqs:
            tokens, *lp = launched.host.get()  # the one host sync of a step
            tokens = tokens.tolist()
            rows = launched.logprob_rows
            logprobs = logprobs_to_host((*rows, *lp)) if rows else [None] * len(tokens)
            now = time.monotonic()
            for req, tok, logprob in zip(launched.reqs, tokens, logprobs, strict=True):
                if req.finished:  # stopped or aborted after this step was launched: drop the row
                    continue
                req.num_pending -= 1
                if req.first_token_time is None:
                    req.first_token_time = now
                self._append(req, tok, logprob)
                if req.finished:
                    req.num_pending = 0
                changed.append(req)
        for req in launched.step.requests:
            if req.finished:
                self.requests.pop(req.request_id, None)
                req.penalty = None  # its device tensors (the caller may keep the request)
            else:
                self.scheduler.register_computed(req)
        return changed

    def _append(self, req: Request, tok: int, logprob=None) -> None:
        """Take one sampled token, then apply the stop rules (vLLM's): the EOS or stop token that ends a
        request is an output token (with its logprob), left out of the text unless
        include_stop_str_in_output; a stop string cuts the text at its start (after its end with
        include_stop_str_in_output); `stop_reason` is the stop token id or string (None for EOS)."""
        p = req.params
        req.output_ids.append(tok)
        if logprob is not None:
            req.logprobs.append(logprob)
        if not req.grammar_on and req.matcher is not None and tok == p.structured.after:
            req.grammar_on = True  # the reasoning is over: the answer from the next token on is held
        elif req.grammar_on:
            if not req.matcher.accept_token(tok):  # the mask allowed only what it accepts: a bug, this request's
                log.error("%s: token %d broke its structured output's grammar; finishing it", req.request_id, tok)
                self._finish(req, "stop", None)
                return
            if req.matcher.is_terminated() and p.ignore_eos:  # terminated: it took one of the EOS ids
                self._finish(req, "stop", None)  # the grammar is complete: nothing more may follow
                return
        if tok in self.eos and not p.ignore_eos:
            self._finish(req, "stop", None)
            return
        if tok in p.stop_token_ids:
            self._finish(req, "stop", tok)
            return
        if self.tokenizer is not None and p.stop and len(req.output_ids) >= p.min_tokens:  # text: stop strings
            decode = self._decoder(p)
            if req.stop_strings is None:
                # with min_tokens, a stop string counts only if it ends after the first min_tokens tokens
                # (their text length, decoded once)
                floor = len(decode(req.output_ids[:p.min_tokens])) if p.min_tokens else 0
                req.stop_strings = StopStrings(decode, p.stop, floor)
            if req.stop_strings.found(req.output_ids):  # a short window decoded per token
                text = decode(req.output_ids)  # the whole output, once
                cut, stop = first_stop(text, p.stop, req.stop_strings.floor)
                if stop is not None:
                    req.text = text[:cut + len(stop) if p.include_stop_str_in_output else cut]
                    req.stop_reason = stop
                    self.scheduler.finish(req, "stop")
                    return
        if len(req.output_ids) >= p.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= self.cfg.max_model_len:
            self._finish(req, "length", None)

    def _decoder(self, p: SamplingParams):
        """The text of token ids as `p` asks (special tokens skipped by default)."""
        if p.skip_special_tokens:
            return self.tokenizer.decode
        return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)

    def _finish(self, req: Request, reason: str, stop_reason: int | None) -> None:
        """Finish by EOS / stop token (`reason` "stop": the last output token, out of the text) or length."""
        if self.tokenizer is not None:  # decoded once, at the end
            keep = reason != "stop" or req.params.include_stop_str_in_output
            req.text = self._decoder(req.params)(req.output_ids if keep else req.output_ids[:-1])
        req.stop_reason = stop_reason
        self.scheduler.finish(req, reason)

    # prompt scoring (`scoring.py`) -----------------------------------------------------------------
    def prompt_logprobs(self, token_ids: list[int], adapter: str | None, k: int) -> list:
        """Per prompt token: its logprob given the tokens before it, its rank there and the k most likely
        tokens, as `(logprob, rank, ((id, logprob), ...))`; the first token has none: `(None, None, ())`.
        Forwards of its own (the prefix cache not read; `scoring.py`), for completions' `echo` with `logprobs`."""
        out = self.prompt_logprobs_batch([(token_ids, adapter, k)])[0]
        if isinstance(out, RequestError):
            raise out
        return out

    def prompt_logprobs_batch(self, items: Sequence[tuple[list[int], str | None, int]]) -> list[list | RequestError]:
        """`prompt_logprobs` of many (token ids, adapter, k) in shared forwards; per item its entries, or the
        RequestError that kept it out (the others are scored)."""
        self._settle_in_flight()
        return scoring.prompt_logprobs(self, items)

    def prompt_logits(self, token_ids: list[list[int]], adapters: list[str | None]) -> list[torch.Tensor]:
        """fp32 logits of every position of each sequence (the prefix cache not read), in forwards of the step
        budget."""
        self._settle_in_flight()
        return scoring.prompt_logits(self, token_ids, adapters)

    def _settle_in_flight(self) -> None:
        if self._launched is not None:  # overlapped scheduling: settle the step in flight first
            launched, self._launched = self._launched, None
            self._settled += self._read_back(launched)  # reported by the next step()
