"""`AsyncEngine`: the one thread that owns the `LLMEngine`, and the asyncio face of it.

Everything that touches the engine (add, abort, step, adapter load/unload, reading its state)
runs in a single background thread, so the engine needs no locks. Callers on the event loop
send commands through a thread-safe queue; the thread drains the queue, steps while there is
work (and blocks on the queue while there is none), and hands each request's new token ids to
its asyncio queue with one `loop.call_soon_threadsafe` per step. The thread only ships token
ids: detokenisation happens on the event loop (`engine/detokenize.py`), off the step's critical path.

The thread first runs the warm-up (`engine/warmup.py`, unless `EngineConfig.warmup` is off; beside it a thread
builds the structured-output compiler) and only then reports `ready`; commands sent meanwhile wait in the queue.
After every command batch and every step the thread publishes an immutable `EngineStats` (queue lengths, KV
and adapter-slot use, the registered adapters, cumulative preemption and prefix-cache counters), which the
server reads without touching the engine. A `RequestObserver` (the server's metrics) hears, on the engine
thread, of every request added, every delivery of tokens and every sequence finished (with the engine's timestamps on
the `Request`). Admission control: `open()` refuses (`Overloaded`) while the requests not yet scheduled
(in the command queue or the scheduler's waiting list) reach `max_waiting`; the count is exact because
both sides update it under one lock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from moelora.engine.engine import LLMEngine
from moelora.engine.request import Request, SamplingParams
from moelora.engine.scoring import NoFreeBlocks
from moelora.engine.warmup import warm_up
from moelora.errors import AdapterError, MoeLoRAError, WorkerError

log = logging.getLogger("moelora.server")


class UnknownAdapter(MoeLoRAError):
    """No adapter of that name is registered."""


class AdapterBusy(MoeLoRAError):
    """The adapter has requests in flight."""


class Overloaded(MoeLoRAError):
    """Too many requests are waiting to be scheduled."""


class EngineDead(MoeLoRAError):
    """The engine thread is not running (shut down or crashed)."""


@dataclass(frozen=True)
class GenerateSpec:
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    n: int = 1  # choices of this prompt (the request's n): the specs of one prompt are consecutive
    cache_salt: str | None = None  # vLLM's: a prefix-cache namespace of its own (`LLMEngine.add_request`)
    priority: int = 0  # vLLM's: with the priority scheduling policy, lower first


class RequestObserver(Protocol):
    """Hears of requests on the engine thread (keep it cheap: it runs between steps)."""

    def added(self, specs: Sequence[GenerateSpec]) -> None: ...

    def tokens(self, req: Request, new: int, gap: float | None) -> None:
        """`new` tokens delivered; `gap`: seconds since the request's previous delivery (None: its first)."""

    def finished(self, req: Request, reason: str) -> None: ...

    def step(self, tokens: int) -> None:
        """A step was scheduled that computes `tokens` tokens (prefill chunks and decodes)."""

    def scored(self, score: ScoreRequest, started: float, end: float, reason: str) -> None:
        """A request that generates nothing (echo with max_tokens 0) was scored: `started` / `end` bound its
        forwards; `reason` is "length", or "error" when they failed."""


@dataclass(frozen=True)
class ScoreRequest:
    """A scoring-only request (its prompt's logprobs and nothing generated), as the observer reports it: vLLM
    counts such a request among its finished requests."""

    prompt_tokens: int
    n: int
    arrival: float  # time.monotonic() when it was sent to the engine thread


@dataclass(frozen=True)
class _ScoreCall:
    """A queued prompt_logprobs command (the engine thread's `_scoring` queue)."""

    token_ids: list[int]
    adapter: str | None
    k: int
    score: ScoreRequest | None  # set: a scoring-only request, reported to the observer
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def resolve(self, result=None, error: BaseException | None = None) -> None:
        _resolve(self.loop, self.future, result=result, error=error)


@dataclass(frozen=True)
class Delta:
    """What one step produced for one sequence of a stream (`index` into the stream's specs)."""

    index: int
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None  # stop | length | abort | error, or None while running
    final_text: str | None  # the engine's whole text, once finished (cut at a stop string)
    time: float  # time.monotonic() after the step
    error: str | None = None
    stop_reason: int | str | None = None  # once finished: the stop token id or string that matched
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (at the sequence's last admission)


@dataclass(frozen=True)
class EngineStats:
    waiting: int = 0
    running: int = 0
    kv_used: int = 0
    kv_total: int = 0
    slots_in_use: int = 0
    slots_total: int = 0
    loads: int = 0
    evictions: int = 0
    adapters: tuple[tuple[str, str], ...] = ()  # (name, path) of every registered adapter, in load order
    in_flight: dict[str | None, int] = field(default_factory=dict)  # live sequences per adapter
    preemptions: int = 0  # cumulative, as the scheduler counts them
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    running_adapters: tuple[str, ...] = ()  # adapters of the running requests (sorted)
    waiting_adapters: tuple[str, ...] = ()  # adapters of the waiting requests (sorted)
    time: float = 0.0  # time.time() when published


@dataclass
class _Live:
    stream: RequestStream
    index: int
    adapter: str | None
    req: Request
    sent: int = 0
    last_time: float | None = None  # when its last tokens were delivered


class RequestStream:
    """The event-loop side of one HTTP request's sequences: an async iterator of `Delta`s."""

    def __init__(self, engine: AsyncEngine, n: int, loop: asyncio.AbstractEventLoop):
        self._engine, self.loop = engine, loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.request_ids = [f"{engine.next_id()}-{i}" for i in range(n)]
        self._open = set(range(n))

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if not self._open:
            raise StopAsyncIteration
        delta = await self.queue.get()
        if delta.finish_reason is not None:
            self._open.discard(delta.index)
        return delta

    @property
    def finished(self) -> bool:
        return not self._open

    def abort(self) -> None:
        """Abort every unfinished sequence (safe to call from `finally`, even when cancelled)."""
        if self._open:
            self._engine.send(("abort", [self.request_ids[i] for i in self._open]))
            self._open.clear()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, adapters: dict[str, str] | None = None, max_waiting: int = 1024):
        self.engine, self.max_waiting = engine, max_waiting
        self._adapters = dict(adapters or {})  # name -> path, owned by the engine thread after start
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._scoring: deque[_ScoreCall] = deque()  # prompt_logprobs commands not run yet (the engine thread's)
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._pending = 0  # sequences sent to `open` and not yet added to the engine
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()  # set once the warm-up (EngineConfig.warmup) is done
        self.warmup: dict | None = None  # what it did ({"forwards", "seconds"}) or {"error"}; None: not run
        self._observer: RequestObserver | None = None
        self._publish()

    # event-loop side ----------------------------------------------------------------------------
    def next_id(self) -> str:
        return f"srv{next(self._ids)}"

    def send(self, command: tuple) -> None:
        self._commands.put(command)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def ready(self) -> bool:
        """Running and warmed up: no request will compile a kernel (requests sent before are queued)."""
        return self.alive and self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout) and self.alive

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def queue_length(self) -> int:
        with self._lock:
            return self._pending + self._stats.waiting

    async def open(self, specs: Sequence[GenerateSpec]) -> RequestStream:
        """Add every spec as one engine request (all or none); raises UnknownAdapter, RequestError,
        Overloaded or EngineDead."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._pending + self._stats.waiting >= self.max_waiting:
                raise Overloaded(f"{self._pending + self._stats.waiting} requests are waiting "
                                 f"(limit {self.max_waiting}); retry later")
            self._pending += len(specs)
        formats = {s.params.structured for s in specs if s.params.structured is not None}
        if formats:  # compiled here, off the engine thread (which then finds them compiled)
            try:
                await loop.run_in_executor(None, _compile_all, self.engine, formats)
            except BaseException:
                with self._lock:
                    self._pending -= len(specs)
                raise
        stream = RequestStream(self, len(specs), loop)
        future = loop.create_future()
        self.send(("add", stream, list(specs), loop, future))
        try:
            await future
        except BaseException:  # refused, or cancelled: an add that still happens is undone by the abort after it
            stream.abort()
            raise
        return stream

    async def load_adapter(self, name: str, path: str) -> None:
        await self._call("load", name, path)

    async def unload_adapter(self, name: str) -> None:
        await self._call("unload", name)

    async def prompt_logprobs(self, token_ids: list[int], adapter: str | None, k: int, alone_n: int = 0) -> list:
        """`LLMEngine.prompt_logprobs`, run on the engine thread between steps, in the forwards of every call
        queued with it (`_score`). `alone_n` > 0: the prompt's request, of that many choices, generates nothing,
        so the observer hears of it as a finished request (else the generation that follows is reported)."""
        score = ScoreRequest(len(token_ids), alone_n, time.monotonic()) if alone_n else None
        return await self._call("prompt_logprobs", token_ids, adapter, k, score)

    async def _call(self, kind: str, *args):
        if not self.alive:
            raise EngineDead("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.send((kind, *args, loop, future))
        return await future

    def observe(self, observer: RequestObserver) -> None:
        """Report requests to `observer` (before `start`: the engine thread then owns it)."""
        if self._thread is not None:
            raise MoeLoRAError("observe() must be called before start()")
        self._observer = observer

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="moelora-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self.send(("stop",))
        self._thread.join(timeout)
        if not self._thread.is_alive():  # commands sent while it stopped still get an answer
            self._drain_commands("the engine stopped")
        self.engine.close()  # a tensor-parallel engine's workers

    # engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.engine.cfg.warmup:
                grammars = threading.Thread(target=_build_grammars, args=(self.engine,), name="moelora-grammars",
                                            daemon=True)
                grammars.start()  # beside the warm-up's forwards: the first structured request then waits for none
                try:
                    self.warmup = warm_up(self.engine)
                except Exception as e:  # a request of that shape may fail as well, but the others should be served
                    log.exception("warm-up failed; serving without it (first requests may compile kernels)")
                    self.warmup = {"error": f"{type(e).__name__}: {e}"}
                grammars.join()
            self._ready.set()
            while True:
                busy = self.engine.has_unfinished() or self._scoring
                command = self._commands.get() if not busy else self._get_nowait()
                while command is not None:
                    if command[0] == "stop":
                        return
                    if command[0] == "prompt_logprobs":
                        self._scoring.append(_ScoreCall(*command[1:]))
                    else:
                        self._execute(command)
                    command = self._get_nowait()
                if self._scoring:
                    self._score()
                self._publish()
                if self.engine.has_unfinished() and not self._stopping:
                    self._step()
                if self._stopping:
                    return
        except BaseException:
            log.exception("engine thread crashed")
            raise
        finally:
            self._stopping = True
            self._fail_live("the engine stopped")
            self._drain_commands("the engine stopped")

    def _get_nowait(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _execute(self, command: tuple) -> None:
        kind, *args = command
        if kind == "abort":
            for rid in args[0]:
                live = self._live.pop(rid, None)
                if live is not None:
                    self.engine.abort(rid)
                    if self._observer is not None:
                        self._observer.finished(live.req, "abort")
            return
        *payload, loop, future = args
        try:
            result = getattr(self, f"_do_{kind}")(*payload)
        except Exception as e:  # delivered to the caller, the thread keeps serving
            _resolve(loop, future, error=e)
        else:
            self._publish()  # before the caller hears back: it may read the stats next
            _resolve(loop, future, result=result)

    def _do_add(self, stream: RequestStream, specs: list[GenerateSpec]) -> None:
        added = []
        try:
            for i, (rid, spec) in enumerate(zip(stream.request_ids, specs, strict=True)):
                if spec.adapter is not None and spec.adapter not in self._adapters:
                    raise UnknownAdapter(f"adapter {spec.adapter!r} is not loaded")
                req = self.engine.add_request(spec.prompt_ids, spec.params, spec.adapter, request_id=rid,
                                              cache_salt=spec.cache_salt, priority=spec.priority)
                added.append(rid)
                self._live[rid] = _Live(stream, i, spec.adapter, req)
        except Exception:
            for rid in added:
                self._live.pop(rid, None)
                self.engine.abort(rid)
            raise
        finally:
            with self._lock:
                self._pending -= len(specs)
                self._publish()
        if self._observer is not None:
            self._observer.added(specs)

    def _score(self) -> None:
        """`LLMEngine.prompt_logprobs_batch` of the queued prompt_logprobs commands, in order, up to one step
        budget of tokens (at least one command): a long queue of them takes turns with the generation steps.
        Each caller hears its own result or error; a sequence whose KV blocks the generating requests hold
        (`NoFreeBlocks`) goes back to the queue's front, to be scored after a step, and so does one whose adapter
        would need a slot the running requests' adapters hold."""
        commands, tokens, budget = [], 0, self.engine.cfg.max_num_batched_tokens
        # adapters the running requests hold keep their slots: a prompt of another adapter waits for a free one
        # (as the scheduler's admission does) instead of evicting one the next step copies back in
        held, free = self.engine.scheduler.running_adapters(), self.engine.pool.max_loras
        waiting = []
        while self._scoring and (not commands or tokens + len(self._scoring[0].token_ids) <= budget):
            command = self._scoring.popleft()
            name = command.adapter
            if name is not None and name not in self._adapters:  # unloaded since the request named it
                command.resolve(error=UnknownAdapter(f"adapter {name!r} is not loaded"))
                continue
            if name is not None and name not in held:
                if len(held) >= free and self.engine.has_unfinished():
                    waiting.append(command)
                    continue
                held = held | {name}
            commands.append(command)
            tokens += len(command.token_ids)
        self._scoring.extendleft(reversed(waiting))
        if not commands:
            return
        started = time.monotonic()
        try:
            results = self.engine.prompt_logprobs_batch([(c.token_ids, c.adapter, c.k) for c in commands])
        except WorkerError as e:  # a tensor-parallel rank is gone: the engine stops, as in `_step`
            log.error("engine stopped: %s", e)
            self._stopping = True
            self._fail_live(f"the engine stopped: {e}")
            results = [EngineDead(f"the engine stopped: {e}")] * len(commands)
        except Exception as e:  # a failed forward fails these callers, the thread keeps serving
            log.exception("prompt scoring failed")
            results = [e] * len(commands)
        self._publish()
        end, retry = time.monotonic(), []
        for command, result in zip(commands, results, strict=True):
            if isinstance(result, NoFreeBlocks) and self.engine.has_unfinished():
                retry.append(command)  # after the generation steps that hold the blocks
                continue
            failed = isinstance(result, Exception)
            if command.score is not None and self._observer is not None:
                self._observer.scored(command.score, started, end, "error" if failed else "length")
            if failed:
                command.resolve(error=result)
            else:
                command.resolve(result=result)
        self._scoring.extendleft(reversed(retry))

    def _do_load(self, name: str, path: str) -> None:
        if name in self._adapters:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        self.engine.pool.add(name, path)
        self._adapters[name] = path

    def _do_unload(self, name: str) -> None:
        if name not in self._adapters:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
        busy = sum(1 for live in self._live.values() if live.adapter == name)
        if busy:
            raise AdapterBusy(f"adapter {name!r} has {busy} requests in flight; retry when they finish")
        self.engine.pool.remove(name)
        del self._adapters[name]  # its cached KV is keyed by pool.cache_key: a reload never reuses it

    def _step(self) -> None:
        steps = self.engine.scheduler.num_steps
        try:
            changed = self.engine.step()
        except WorkerError as e:  # a tensor-parallel rank is gone: the engine stops (503s, /health fails)
            log.error("engine stopped: %s", e)
            self._stopping = True
            self._fail_live(f"the engine stopped: {e}")
            return
        except Exception as e:  # a failed step fails the requests in it, not the server
            log.exception("engine step failed")
            self._fail_live(f"engine step failed: {type(e).__name__}: {e}")
            return
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        observer = self._observer
        if observer is not None and self.engine.scheduler.num_steps != steps:
            observer.step(self.engine.scheduler.last_step_tokens)
        for req in changed:
            live = self._live.get(req.request_id)
            if live is None:
                continue
            new = req.output_ids[live.sent:]
            logprobs = req.logprobs[live.sent:] if req.params.logprobs is not None else []
            live.sent = len(req.output_ids)
            final = req.text if req.finished else None
            if observer is not None and (new or (live.last_time is None and req.first_token_time is not None)):
                observer.tokens(req, len(new), None if live.last_time is None else now - live.last_time)
                live.last_time = now
            if req.finished:
                del self._live[req.request_id]
                if observer is not None:
                    observer.finished(req, req.finish_reason)
            delta = Delta(live.index, new, logprobs, req.finish_reason, final, now, stop_reason=req.stop_reason,
                          cached_tokens=req.num_cached_tokens)
            batches[live.stream.loop].append((live.stream.queue, delta))
        self._publish()  # before the tokens: a client that has them sees stats that include this step
        for loop, items in batches.items():
            _deliver(loop, items)

    def _fail_live(self, message: str) -> None:
        """Abort every live request and tell its stream why."""
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for rid, live in list(self._live.items()):
            self.engine.abort(rid)
            if self._observer is not None:
                self._observer.finished(live.req, "error")
            batches[live.stream.loop].append(
                (live.stream.queue, Delta(live.index, [], [], "error", None, now, error=message)))
        self._live.clear()
        for loop, items in batches.items():
            _deliver(loop, items)
        self._publish()

    def _drain_commands(self, message: str) -> None:
        """On the way out: answer every caller still waiting on a command."""
        while self._scoring:
            self._scoring.popleft().resolve(error=EngineDead(message))
        while (command := self._get_nowait()) is not None:
            if command[0] in ("abort", "stop"):
                continue
            if command[0] == "add":
                with self._lock:
                    self._pending -= len(command[2])
            _resolve(command[-2], command[-1], error=EngineDead(message))

    def _publish(self) -> None:
        eng, pool, sched = self.engine, self.engine.pool, self.engine.scheduler
        in_flight: dict[str | None, int] = defaultdict(int)
        for live in self._live.values():
            in_flight[live.adapter] += 1
        running = {r.adapter for r in sched.running if r.adapter is not None}
        running.update(r.adapter for r in sched.held if r.adapter is not None)
        waiting = {r.adapter for r in sched.waiting if r.adapter is not None}
        self._stats = EngineStats(
            waiting=len(sched.waiting), running=len(sched.running),
            kv_used=eng.cache.allocator.num_used, kv_total=eng.cache.allocator.num_blocks,
            slots_in_use=pool.slots_in_use(), slots_total=pool.max_loras, loads=pool.loads,
            evictions=pool.evictions, adapters=tuple(self._adapters.items()), in_flight=dict(in_flight),
            preemptions=sched.num_preemptions, prefix_queried_tokens=sched.prefix_queried_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens, running_adapters=tuple(sorted(running)),
            waiting_adapters=tuple(sorted(waiting)), time=time.time())


def _deliver(loop: asyncio.AbstractEventLoop, items: list) -> None:
    def put_all():
        for q, delta in items:
            q.put_nowait(delta)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result=None, error=None) -> None:
    def set_():
        if future.done():  # the caller was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    try:
        loop.call_soon_threadsafe(set_)
    except RuntimeError:
        pass


def _build_grammars(engine) -> None:
    """The structured-output compiler over the tokenizer (`LLMEngine.grammars`: its vocabulary read, xgrammar's
    tokenizer info built: 1-2.5 s at a 151k-token vocabulary), made at start-up rather than by the first request
    that names a format. A failure is the first such request's to report."""
    if engine.tokenizer is None:
        return
    try:
        engine.grammars()
    except Exception as e:  # e.g. no xgrammar: requests with a format get the error, the rest are served
        log.warning("structured outputs not prepared at start-up: %s", e)


def _compile_all(engine, formats) -> None:
    """Compile a request's structured-output formats (engine/structured.py) in a worker thread: a large schema's
    compile then never holds the engine thread's steps."""
    grammars = engine.grammars()
    for so in formats:
        grammars.compile(so)
