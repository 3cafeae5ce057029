"""Piecewise CUDA graphs: a step with prompt rows (a prefill chunk, alone or beside decodes) of up to
`EngineConfig.piecewise_graph_tokens` tokens replays L + 1 captured graphs, each layer's attention running
eagerly between two of them. Without them such a step runs eagerly: ~10 Triton launches and ~30 torch ops a
layer (`benchmarks/launch_count.py`), each ~10-100 us of host time, for a few us of device work at these sizes,
so a serving step that takes a new prompt beside its decodes costs several decode steps.

Shape legend: T the step's tokens, B the bucket (T rounded up to a captured size), H hidden, L layers.

The pieces of one bucket:
  piece 0   the embedding, rotary, the step's LoRA plan (`plan_step` from the static slot buffer, as a decode
            graph builds it), layer 0's input norm and its attention's `project` (projections, rotations, the
            step's KV entries stored at the static slot mapping);
  piece i   layer i-1's o_proj, post-attention norm and MLP / MoE (`DecoderLayer.after_attention`), then layer
            i's input norm and `project`;
  piece L   the last layer's rest and the final norm.
Between pieces i and i+1 the layer's `attend` runs eagerly on the step's T real rows with the step's own
metadata and LoRA batch (its grid, host loops and MLA's context expansion follow the step's sequences) and its
output is copied into a static buffer piece i+1 reads. What crosses a piece's end lives in static buffers
shared by every bucket (views of the largest): the residual x and `project`'s state (copied in at the piece's
end), the attention output, the final hidden rows; rotary's cos / sin and the LoRA plan are piece 0's outputs
in the graphs' memory pool, kept for the bucket's later pieces. Pieces replay one at a time, in order, so all
buckets share one pool. Padding rows (T..B) take token 0 at position 0 on no adapter and store their KV entries
in the reserved dummy block; attention never reads them and no sampled row is one of them.

LoRA as in the decode graphs (`cuda_graphs.py`): captured with the engine's idle sites left out and at the
registered adapters' width class, captured again when a step needs more. One set of graphs (no base set): a
step on no adapter replays the LoRA pieces, whose kernels skip its rows.
Single device only: under tensor parallelism the workers run eager steps and would need the same pieces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from moelora.engine.config import EngineConfig
from moelora.engine.cuda_graphs import GraphSet, collection_off
from moelora.engine.runner import StepInputs
from moelora.kernels.side_stream import layer_streams
from moelora.layers.attention import AttnMetadata
from moelora.lora.batch import NO_SLOT, LoRANeeds, plan_step

log = logging.getLogger(__name__)


def piecewise_tokens(cfg: EngineConfig) -> int:
    """The largest step `cfg` (resolved) replays piecewise: `piecewise_graph_tokens` within the step budget, on
    one device with CUDA graphs; 0 when off."""
    if not (cfg.piecewise_graph_tokens and cfg.use_cuda_graphs) or cfg.tensor_parallel_size > 1:
        return 0
    return min(cfg.piecewise_graph_tokens, cfg.max_num_batched_tokens)


def token_buckets(max_tokens: int) -> list[int]:
    """The captured sizes: powers of two from 16 to 256, then every 256, up to `max_tokens` (itself the last).
    At these sizes the projections and experts are bound by their weights' bytes, so padding a step up to
    its bucket costs little device time."""
    sizes = [b for b in (16, 32, 64, 128, 256) if b < max_tokens]
    sizes += list(range(512, max_tokens, 256))
    return sizes + [max_tokens]


class CudaCapture:
    """Each piece a `torch.cuda.CUDAGraph`, all of them in one memory pool (pieces replay one at a time)."""

    def __init__(self):
        self.pool = None

    def __call__(self, fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=layer_streams(torch.device("cuda")).capture):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out


class PiecewiseGraphs(GraphSet):
    what = "piecewise graphs"

    def __init__(self, model, cache, max_tokens: int, dummy_block: int, needs: LoRANeeds,
                 capture: Callable[[], Callable] = CudaCapture):
        """`capture()`: a new capturer, `capturer(fn) -> (graph, fn's outputs)`, one a capture of every bucket
        (CUDA graphs; tests give a stand-in that replays by calling fn again)."""
        self.model, self.cache, self.needs = model, cache, needs
        self.buckets = token_buckets(max_tokens)
        self.new_capturer = capture
        self.layers = list(model.model.layers)
        dev, dtype = cache.layers[0][0].device, model.model.embed_tokens.weight.dtype
        Tm, H = self.buckets[-1], model.config.hidden_size
        self.dummy_slot = dummy_block * cache.block_size
        self.input_ids = torch.zeros(Tm, dtype=torch.long, device=dev)
        self.positions = torch.zeros(Tm, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((Tm,), self.dummy_slot, dtype=torch.long, device=dev)
        self.token_slots = torch.full((Tm,), NO_SLOT, dtype=torch.int32, device=dev)
        self.x = torch.zeros(Tm, H, dtype=dtype, device=dev)  # the residual stream entering a layer's attention
        self.attn_out = torch.zeros(Tm, self.layers[0].self_attn.o_proj.in_features, dtype=dtype, device=dev)
        self.hidden = torch.zeros(Tm, H, dtype=dtype, device=dev)
        self.state: list[torch.Tensor] = []  # `project`'s outputs, made at the first capture (largest bucket)
        self.graphs: dict[int, list] = {}
        self.kept: dict[int, object] = {}  # each bucket's piece-0 outputs (cos, sin, LoRA plan) its pieces read
        self.replays = self.captures = 0
        self.capture_s = 0.0

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def _meta(self, B: int) -> AttnMetadata:
        """What `project` reads of a step's metadata: the slot mapping (the static buffer); the rest is never read
        inside a piece (attention runs outside them), only shaped like a step with prompt rows."""
        dev = self.slot_mapping.device
        return AttnMetadata(self.slot_mapping[:B], torch.zeros(1, 1, dtype=torch.int32, device=dev),
                            torch.full((1,), B, dtype=torch.int32, device=dev),
                            torch.tensor([0, B], dtype=torch.int32, device=dev), (), max_seq_len=B, max_query_len=B)

    def _into(self, B: int, x: torch.Tensor, state: tuple[torch.Tensor, ...]) -> None:
        """A piece's end: x and the attention state into the static buffers (made at the first capture)."""
        if not self.state:
            Tm = self.buckets[-1]
            self.state = [torch.zeros(Tm, *s.shape[1:], dtype=s.dtype, device=s.device) for s in state]
        self.x[:B].copy_(x)
        for buf, s in zip(self.state, state, strict=True):
            buf[:B].copy_(s)

    def _pieces(self, B: int, with_lora: bool) -> list[Callable[[], object]]:
        model, layers, kv = self.model, self.layers, self.cache.layers
        meta = self._meta(B)
        kept: dict = {}

        def first():
            lora = plan_step(self.token_slots[:B], None, self.lora_width, None, self.needs,
                             self.lora_idle) if with_lora else None
            cos, sin = model.rotary(self.positions[:B])
            x, normed, rows = layers[0].attention_input(model.model.embed_tokens(self.input_ids[:B]), None)
            self._into(B, x, layers[0].self_attn.project(normed, cos, sin, meta, kv[0], lora, rows))
            kept.update(cos=cos, sin=sin, lora=lora)
            return cos, sin, lora

        def middle(i: int):
            def run():
                prev, layer, lora = layers[i - 1], layers[i], kept["lora"]
                h, delta = prev.after_attention(self.x[:B], prev.self_attn.output(self.attn_out[:B], None, lora), lora)
                x, normed, rows = layer.attention_input(h, delta)
                self._into(B, x, layer.self_attn.project(normed, kept["cos"], kept["sin"], meta, kv[i], lora, rows))
            return run

        def last():
            prev, lora = layers[-1], kept["lora"]
            h, delta = prev.after_attention(self.x[:B], prev.self_attn.output(self.attn_out[:B], None, lora), lora)
            self.hidden[:B].copy_(model.model.norm.add_forward(h, delta)[1])

        return [first, *(middle(i) for i in range(1, len(layers))), last]

    @torch.inference_mode()
    def capture(self, lora_idle: frozenset = frozenset(), lora_width: int | None = None) -> None:
        """Capture every bucket's pieces (again: the old graphs and their pool are released first) with
        `lora_idle` left out, at LoRA width `lora_width` (its `width_class`; None: the pool's)."""
        cuda = self.x.is_cuda
        if self.graphs:
            if cuda:
                torch.cuda.synchronize()
            self.graphs.clear()
            self.kept.clear()
        self._pad_rows(0, self.buckets[-1])  # the warm-up and capture store into the dummy block only
        t0 = time.perf_counter()
        self.lora_idle, self.lora_width = lora_idle, self.width_class(lora_width)
        self.captures += 1
        with_lora = bool(self.model.max_loras)
        if cuda:  # warm-up on a side stream: compile the kernels, settle the allocator
            side = layer_streams(self.x.device).capture  # never a layer's side stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for B in reversed(self.buckets):
                    for piece in self._pieces(B, with_lora):
                        piece()
            torch.cuda.current_stream().wait_stream(side)
        with collection_off():
            capturer = self.new_capturer()
            for B in reversed(self.buckets):  # largest first: the pool is sized by it
                graphs = []
                for i, piece in enumerate(self._pieces(B, with_lora)):
                    graph, out = capturer(piece)
                    graphs.append(graph)
                    if i == 0:
                        self.kept[B] = out
                self.graphs[B] = graphs
        if cuda:
            torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """A step of T <= the largest bucket tokens -> the logits of its sampled rows [n, V] (fp32)."""
        return self.model.logits(self.hidden_states(inputs).index_select(0, inputs.sample_rows)).float()

    @torch.inference_mode()
    def hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """A step of T <= the largest bucket tokens -> its final-norm hidden states [T, H] (a view of the static
        buffer: the next replay overwrites it)."""
        T, B = self._load_rows(inputs)
        meta = inputs.meta
        if T < B:
            self._pad_rows(T, B)
        graphs = self.graphs[B]
        for layer, graph, kv in zip(self.layers, graphs, self.cache.layers, strict=False):
            graph.replay()
            # rows quantized for a W8A8 o_proj come from a decode step's attention only; the captured o_proj
            # quantizes its input itself (the same 1 x 128 groups: heads of 128)
            out, _ = layer.self_attn.attend(tuple(s[:T] for s in self.state), meta, kv, inputs.lora)
            self.attn_out[:T].copy_(out)
        graphs[-1].replay()
        self.replays += 1
        return self.hidden[:T]
