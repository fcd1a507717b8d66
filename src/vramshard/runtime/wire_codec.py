"""bf16 weights over PCIe in 0.754 of their bytes, bit for bit.

A streamed sub-layer's bytes cross the link once a step, so wherever the copy engine is the critical
path, the link's bytes set the step. The exponents of weights, trained or random, take few values: across
trained LLMs a bf16 weight's 8 exponent bits carry about 2.6 bits of entropy and about 40 of the 256 values
occur (DFloat11, Zhang et al. 2025, arXiv:2504.11651, which Huffman-codes them to ~0.68 of the bytes for
weights kept in VRAM). For a copy engine and a decode that must keep up with it, a simpler fixed-size code:
each block of :data:`BLOCK` 16-bit words is coded in :data:`CODED_BLOCK` bytes::

    table  uint8 [15]     the block's 15 most frequent exponents (codes 0..14)
    flag   uint8          1: the block had more than ESCAPES escapes (its words are copied raw instead)
    sm     uint8 [BLOCK]  each word's sign bit and 7 mantissa bits, as they are
    codes  uint8 [BLOCK/2]  word 2i's code in the low nibble, word 2i+1's in the high one; 15: an escape
    esc    uint8 [ESCAPES]  the exponents of the escaped words, in word order

Blocks of a fixed size make any run of blocks one contiguous copy whose decode needs no index: one
Triton program a block (:func:`decode_into`; torch's ops without a GPU) rebuilds the words at HBM speed.
Any 16-bit words round-trip exactly; words whose exponent field takes many values (fp16 and fp32
bytes, noise) overflow their blocks, which are then copied raw, and :class:`CodedBuffer` keeps such a
buffer raw altogether.

:class:`CodedBuffer` holds a packed host buffer's coded blocks beside it; :meth:`CodedBuffer.fill` puts
any byte range of it in VRAM through a small staging buffer: the whole blocks inside the range coded,
in rounds of at most the staging's size, the ragged ends and overflowed blocks raw. On a GPU the rounds
alternate between the staging's two halves and decode on their own stream (:class:`OverlappedDecode`), and a
fill made before is replayed from a CUDA graph of its copies and decodes (:data:`FILL_GRAPHS`).
"""

from __future__ import annotations

import bisect
import logging
import weakref
from dataclasses import dataclass

import torch

from ..env import switch
from .pinned_host import host_empty, pinned_empty

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch): the torch decode serves
    triton = None

BLOCK = 4096  # 16-bit words a coded block holds (8 KiB raw)
BLOCK_BYTES = 2 * BLOCK
ESCAPES = 16  # escaped exponents a block holds
ESCAPE = 15  # the code of an escaped word
SM_AT = 16
CODES_AT = SM_AT + BLOCK
ESC_AT = CODES_AT + BLOCK // 2
CODED_BLOCK = ESC_AT + ESCAPES  # 6176 bytes: 0.754 of the raw block
RATIO = CODED_BLOCK / BLOCK_BYTES
# A coded fill issued round by round cost the host about 80 us a round (a copy, a Triton launch, four event calls
# and the stream switches between them), some 20 ms of each llama3-8b decode step planned at 8 GiB (fifty-fourth GPU
# session: the host thread, which also computes the split FFNs' CPU parts, was busy the whole step); replayed from
# a graph the whole fill is one launch. Off: every fill issued round by round.
FILL_GRAPHS = switch("VRAMSHARD_FILL_GRAPHS", True)
STAGING_BYTES = 4096 * CODED_BLOCK  # 24.1 MiB: the coded blocks of one round of a fill (32 MiB raw)
# Raw bytes one round of an overlapped fill carries (a staging half of coded blocks; OverlappedDecode.half_bytes).
ROUND_RAW_BYTES = STAGING_BYTES // 2 // CODED_BLOCK * BLOCK_BYTES  # 16 MiB
MOST_OVERFLOW = 0.01  # a buffer with more of its blocks overflowed stays raw
ENCODE_BLOCKS = 256  # blocks coded at once (its temporaries: about 33 MB)


def enabled() -> bool:
    """``$VRAMSHARD_WIRE_CODEC``: stream bf16 weights coded (on unless set off). On by default since session 57:
    coded fills won every A/B pair on H100 machines (batch 64 at 8 GiB, fiftieth to fifty-second GPU sessions), and
    an engine whose host cannot hold the coded copies plans and fills raw (:func:`holds_coded_copies`)."""
    return switch("VRAMSHARD_WIRE_CODEC", True)


def wire_ratio(dtype: torch.dtype, on: bool | None = None) -> float:
    """Link bytes a streamed fill of weights of ``dtype`` moves per raw byte: :data:`RATIO` for bf16
    with the codec on (``on``; None: :func:`enabled`), else 1."""
    on = enabled() if on is None else on
    return RATIO if on and dtype == torch.bfloat16 else 1.0


HOST_SHARE = 0.5  # the coded copies may take at most this share of the host's available memory


def coded_bytes(raw_bytes: int) -> int:
    """The most host bytes the coded blocks of ``raw_bytes`` of weights take (a part block counts whole)."""
    return -(-raw_bytes // BLOCK_BYTES) * CODED_BLOCK


def host_room(raw_bytes: int, available: int | None) -> int | None:
    """The coded copies' host bytes for ``raw_bytes`` of streamed weights where they fit in
    :data:`HOST_SHARE` of the ``available`` host memory (None where unknown: no limit); None where
    they do not fit (their fills then stay raw: pinned memory past what the host has gets the process
    killed mid-load)."""
    need = coded_bytes(raw_bytes)
    return need if available is None or need <= HOST_SHARE * available else None


def holds_coded_copies(streamable_bytes: int, weights_bytes: int, available: int | None) -> bool:
    """Whether the host can hold the coded copies of ``streamable_bytes`` of weights (every sub-layer a plan
    may stream) once the pinned copy of all ``weights_bytes`` is made: within :data:`HOST_SHARE` of the
    ``available`` memory left then (unknown: yes). An engine decides it before planning, so that its plans
    price the link as its fills will cross it (:class:`~vramshard.runtime.budget.PlanSettings`)."""
    return available is None or host_room(streamable_bytes, available - weights_bytes) is not None


def encode_blocks(words: torch.Tensor) -> torch.Tensor:
    """Code int16 ``words`` [nblocks * BLOCK] (any device): uint8 [nblocks, CODED_BLOCK] there (a view,
    rows not back to back)."""
    if words.dim() != 1 or words.dtype != torch.int16 or words.numel() % BLOCK:
        raise ValueError(f"encode_blocks takes int16 words in whole blocks of {BLOCK}, got "
                         f"{tuple(words.shape)} {words.dtype}")
    w = words.view(-1, BLOCK)
    nb, device = w.shape[0], w.device
    exponent = ((w >> 7) & 0xFF).to(torch.int64)
    counts = torch.zeros(nb, 256, dtype=torch.int32, device=device)
    counts.scatter_add_(1, exponent, torch.ones_like(exponent, dtype=torch.int32))
    table = counts.topk(ESCAPE, dim=1).indices  # [nb, 15]
    lookup = torch.full((nb, 256), ESCAPE, dtype=torch.uint8, device=device)
    lookup.scatter_(1, table, torch.arange(ESCAPE, dtype=torch.uint8, device=device).expand(nb, ESCAPE))
    code = lookup.gather(1, exponent)  # [nb, BLOCK]
    escaped = code == ESCAPE
    rank = escaped.to(torch.int32).cumsum(1) - 1
    out = torch.zeros(nb, CODED_BLOCK + 1, dtype=torch.uint8, device=device)  # (+1: a column for the overflow)
    out[:, :ESCAPE] = table.to(torch.uint8)
    out[:, ESCAPE] = (rank[:, -1] >= ESCAPES).to(torch.uint8)
    out[:, SM_AT:CODES_AT] = (((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8)
    pairs = code.view(nb, BLOCK // 2, 2)
    out[:, CODES_AT:ESC_AT] = pairs[..., 0] | (pairs[..., 1] << 4)
    column = torch.where(escaped & (rank < ESCAPES), ESC_AT + rank, CODED_BLOCK).to(torch.int64)
    out.scatter_(1, column, exponent.to(torch.uint8))
    return out[:, :CODED_BLOCK]


def code_blocks(raw: torch.Tensor, coded: torch.Tensor, device, most_overflow: float) -> list[int] | None:
    """Code the whole blocks of the uint8 buffer ``raw`` into ``coded`` (uint8 [blocks * CODED_BLOCK], on any
    device), :data:`ENCODE_BLOCKS` at a time on ``device``: the indices of the blocks that overflowed, or None
    once more than ``most_overflow`` of them did (``coded`` then holds only a part)."""
    blocks = raw.numel() // BLOCK_BYTES
    overflow: list[int] = []
    for first in range(0, blocks, ENCODE_BLOCKS):
        last = min(blocks, first + ENCODE_BLOCKS)
        words = raw[first * BLOCK_BYTES : last * BLOCK_BYTES].to(device, non_blocking=True).view(torch.int16)
        coded_part = encode_blocks(words)
        overflow.extend(first + int(b) for b in coded_part[:, ESCAPE].nonzero().view(-1).tolist())
        if len(overflow) > most_overflow:
            return None
        coded[first * CODED_BLOCK : last * CODED_BLOCK].view(-1, CODED_BLOCK).copy_(coded_part)
    return overflow


def decode_torch(coded: torch.Tensor) -> torch.Tensor:
    """The words of coded blocks ``coded`` (uint8 [nblocks * CODED_BLOCK]) with torch's ops: int16
    [nblocks * BLOCK] on ``coded``'s device (overflowed blocks' words are garbage, as from the kernel)."""
    c = coded.view(-1, CODED_BLOCK)
    sm = c[:, SM_AT:CODES_AT].to(torch.int32)
    pairs = c[:, CODES_AT:ESC_AT].to(torch.int32)
    code = torch.stack([pairs & 15, pairs >> 4], dim=2).view(c.shape[0], BLOCK)
    escaped = code == ESCAPE
    exponent = c[:, :16].to(torch.int32).gather(1, code.to(torch.int64))
    rank = (escaped.to(torch.int64).cumsum(1) - 1).clamp(0, ESCAPES - 1)
    exponent = torch.where(escaped, c[:, ESC_AT:].to(torch.int32).gather(1, rank), exponent)
    word = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    return torch.where(word >= 0x8000, word - 0x10000, word).to(torch.int16).view(-1)


if triton is not None:

    @triton.jit
    def _decode(coded, out, BLOCK: tl.constexpr, CODED_BLOCK: tl.constexpr, SM_AT: tl.constexpr,
                CODES_AT: tl.constexpr, ESC_AT: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        base = coded + b * CODED_BLOCK
        i = tl.arange(0, BLOCK)
        sm = tl.load(base + SM_AT + i).to(tl.int32)
        pair = tl.load(base + CODES_AT + i // 2).to(tl.int32)
        code = (pair >> ((i % 2) * 4)) & 15
        exponent = tl.load(base + code).to(tl.int32)
        escaped = code == 15
        rank = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
        raw = tl.load(base + ESC_AT + rank, mask=escaped, other=0).to(tl.int32)
        exponent = tl.where(escaped, raw, exponent)
        word = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
        keep = tl.load(base + 15) == 0  # an overflowed block is copied raw after
        tl.store(out + b * BLOCK + i, word.to(tl.int16), mask=keep & (i < BLOCK))


def decode_into(coded: torch.Tensor, out: torch.Tensor) -> None:
    """Decode coded blocks (uint8 [nblocks * CODED_BLOCK]) into ``out`` (int16 [nblocks * BLOCK], same
    device) on the current stream: one Triton launch on a GPU, torch's ops elsewhere. Overflowed blocks
    are left as they were."""
    blocks = coded.numel() // CODED_BLOCK
    if coded.is_cuda and triton is not None:
        _decode[(blocks,)](coded, out, BLOCK=BLOCK, CODED_BLOCK=CODED_BLOCK, SM_AT=SM_AT, CODES_AT=CODES_AT,
                           ESC_AT=ESC_AT)
        return
    keep = coded.view(blocks, CODED_BLOCK)[:, ESCAPE] == 0
    words = decode_torch(coded).view(blocks, BLOCK)
    out.view(blocks, BLOCK)[keep] = words[keep]


@dataclass
class FillStats:
    """Bytes of fills so far: over the link, and what they stand for raw."""

    wire: int = 0
    raw: int = 0


class CodedBuffer:
    """The coded blocks of a packed host buffer ``raw`` (uint8, pinned where it is), made on
    ``device`` (a GPU codes a model in seconds; the CPU of the 2-core development machine 9-16 ns a word).

    ``coded`` is None where more than :data:`MOST_OVERFLOW` of the blocks overflowed: such a buffer
    (an fp16 or fp32 one) is not worth a decode, and fills copy it raw.
    """

    def __init__(self, raw: torch.Tensor, device: torch.device | str = "cpu", pin: bool | None = None):
        if raw.dtype != torch.uint8 or raw.dim() != 1:
            raise ValueError("a coded buffer needs a 1-D uint8 buffer")
        self.raw = raw
        self.blocks = raw.numel() // BLOCK_BYTES  # whole blocks; a ragged end is always copied raw
        pin = raw.is_pinned() if pin is None else pin
        # Exactly its size (torch's pinned allocator would round each up to a power of two: pinned_host).
        coded = (pinned_empty if pin else host_empty)(self.blocks * CODED_BLOCK) if self.blocks else None
        overflow = code_blocks(raw, coded, device, MOST_OVERFLOW * self.blocks) if coded is not None else []
        self.coded = coded if overflow is not None else None
        self.overflow = overflow or []
        # A CUDA graph copies from page-locked memory only: fills from pageable buffers go round by round.
        self.capturable = self.coded is not None and raw.is_pinned() and self.coded.is_pinned()

    @property
    def host_bytes(self) -> int:
        """Host bytes the coded blocks take beside the raw buffer."""
        return 0 if self.coded is None else self.coded.numel()

    def wire_bytes(self, begin: int = 0, end: int | None = None) -> int:
        """Bytes a fill of raw bytes [begin, end) moves over the link."""
        end = self.raw.numel() if end is None else end
        first, last = self._blocks(begin, end)
        if self.coded is None or last <= first:
            return end - begin
        overflowed = bisect.bisect_left(self.overflow, last) - bisect.bisect_left(self.overflow, first)
        return (end - begin) - (last - first) * BLOCK_BYTES + (last - first) * CODED_BLOCK + overflowed * BLOCK_BYTES

    @staticmethod
    def _blocks(begin: int, end: int) -> tuple[int, int]:
        """The whole blocks inside [begin, end)."""
        return -(-begin // BLOCK_BYTES), end // BLOCK_BYTES

    def fill(self, target: torch.Tensor, begin: int, end: int, staging: torch.Tensor,
             stats: FillStats | None = None, overlap: "OverlappedDecode | None" = None) -> None:
        """Put raw bytes [begin, end) into ``target`` (uint8 on the GPU, ``end - begin`` bytes, 2-byte
        aligned) on the current stream: whole blocks coded, through ``staging`` (at least one block;
        the stream's next copy into it waits for the decode before it), the rest raw. With ``overlap``
        (a GPU's), the rounds go through its two halves instead and decode on its stream, each round's
        copy beside the decode of the round before; the current stream then waits for the last decode; and a
        fill of these bytes into ``target`` made before is replayed from its graph
        (:meth:`OverlappedDecode.graph_of`)."""
        first, last = self._blocks(begin, end)
        if self.coded is None or last <= first:
            target.copy_(self.raw[begin:end], non_blocking=True)
            if stats is not None:
                stats.wire += end - begin
                stats.raw += end - begin
            return
        graph = overlap.graph_of(self, target, begin, end) if overlap is not None and overlap.graphs \
            and self.capturable else None
        if graph is not None:
            graph.replay()  # (on the current stream, where the rounds would be issued)
        else:
            self._fill_blocks(target, begin, end, first, last, staging, overlap)
        if stats is not None:
            stats.wire += self.wire_bytes(begin, end)
            stats.raw += end - begin

    def _fill_blocks(self, target: torch.Tensor, begin: int, end: int, first: int, last: int, staging: torch.Tensor,
                     overlap: "OverlappedDecode | None") -> None:
        """Issue a fill of raw bytes [begin, end) whose whole blocks are ``first..last-1``: see :meth:`fill`."""
        head, tail = first * BLOCK_BYTES, last * BLOCK_BYTES
        if head > begin:
            target[: head - begin].copy_(self.raw[begin:head], non_blocking=True)
        if end > tail:
            target[tail - begin :].copy_(self.raw[tail:end], non_blocking=True)
        per_round = max(1, (overlap.half_bytes if overlap is not None else staging.numel()) // CODED_BLOCK)
        for start in range(first, last, per_round):
            stop = min(last, start + per_round)
            source = self.coded[start * CODED_BLOCK : stop * CODED_BLOCK]
            at = start * BLOCK_BYTES - begin
            out = target[at : at + (stop - start) * BLOCK_BYTES].view(torch.int16)
            if overlap is not None:
                overlap.round(source, out)
                continue
            stage = staging[: source.numel()]
            stage.copy_(source, non_blocking=True)
            decode_into(stage, out)
        for block in self.overflow[bisect.bisect_left(self.overflow, first) : bisect.bisect_left(self.overflow, last)]:
            at = block * BLOCK_BYTES
            target[at - begin : at - begin + BLOCK_BYTES].copy_(self.raw[at : at + BLOCK_BYTES], non_blocking=True)
        if overlap is not None:
            overlap.finish()


class OverlappedDecode:
    """Coded fills' rounds through the two halves of a staging buffer, decoded on ``decode_stream``: round r's
    blocks are copied into half r % 2 on the current (copy) stream, which first waits for that half's last
    decode, and decoded on the decode stream once copied; so each round's copy runs beside the decode of the
    round before (one staging buffer, one stream, serialised them: a llama3-8b FFN's fill took 5.26-5.32 ms
    against its coded bytes' bound of 4.79 ms, its decodes 0.31-0.35 ms of it; fiftieth and fifty-first GPU
    sessions). The ring gives it a stream of its own: on the pinned coded weights' decode stream (in order) the pins'
    decodes queued behind link rounds waiting for their copies, and link rounds behind pin decodes waiting for a free
    slot (fifty-second GPU session).

    With ``graphs``, the second fill of the same bytes into the same place (a streamed sub-layer's fill into the
    same slot, a step later) is captured as a CUDA graph of its copies and decodes, and that fill and every one
    after it is one replay (:meth:`graph_of`); the first runs round by round, so the decode kernel is built for
    its arguments before any capture. A graph holds the addresses it was captured with: it is kept for that coded
    buffer (and goes with it), that target and this staging, and a fill into any other place is captured anew."""

    def __init__(self, staging: torch.Tensor, decode_stream: torch.cuda.Stream, graphs: bool | None = None):
        half = staging.numel() // 2 // CODED_BLOCK * CODED_BLOCK
        if half < CODED_BLOCK:
            raise ValueError("an overlapped decode needs a staging buffer of at least two coded blocks")
        self.halves = (staging[:half], staging[half : 2 * half])
        self.half_bytes = half
        self.stream = decode_stream
        self.copied = (torch.cuda.Event(), torch.cuda.Event())
        self.decoded = (torch.cuda.Event(), torch.cuda.Event())
        self.rounds = 0
        self._last: torch.cuda.Event | None = None  # the last decode of the fill under way
        self.graphs = FILL_GRAPHS if graphs is None else graphs
        # {coded buffer: {(target address, begin, end): its fill's graph; None: seen once; False: its capture failed}}
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._unused: list[bool] | None = None  # while capturing: the halves no round of the capture has used yet
        self.captures = 0  # fills captured as graphs
        self.replays = 0  # fills replayed from them

    def graph_of(self, coded: "CodedBuffer", target: torch.Tensor, begin: int,
                 end: int) -> "torch.cuda.CUDAGraph | None":
        """The graph of ``coded``'s fill of raw bytes [begin, end) into ``target``: captured now if this fill was
        made once before; None the first time (fill it round by round) or where its capture failed."""
        fills = self._graphs.setdefault(coded, {})
        key = (target.data_ptr(), begin, end)
        if key not in fills:
            fills[key] = None  # seen: the next fill of these bytes into this place is captured
            return None
        graph = fills[key]
        if graph is False:
            return None
        if graph is None:
            first, last = coded._blocks(begin, end)
            graph = fills[key] = self._capture(lambda: coded._fill_blocks(target, begin, end, first, last, None, self))
            if graph is False:
                return None
        self.replays += 1
        return graph

    def _capture(self, issue) -> "torch.cuda.CUDAGraph | bool":
        """A CUDA graph of the work ``issue`` queues on the current stream and, through this decode's events, on
        the decode stream; False (logged once) where the capture fails. Nothing runs while capturing."""
        eager = (self.copied, self.decoded, self.rounds, self._last)
        self.copied = (torch.cuda.Event(), torch.cuda.Event())
        self.decoded = (torch.cuda.Event(), torch.cuda.Event())
        self.rounds, self._last, self._unused = 0, None, [True, True]
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the run-ahead worker's CUDA calls on its own thread may go on meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                issue()
            finally:
                graph.capture_end()
        except RuntimeError as exc:  # (graph_of asks only while the graphs are on: logged once)
            log.warning("a coded fill could not be captured as a CUDA graph (%s); coded fills go round by round", exc)
            self.graphs = False  # (one failure: every later fill round by round)
            return False
        finally:
            self.copied, self.decoded, self.rounds, self._last = eager
            self._unused = None
        if not self.captures:
            log.info("coded fills replay from CUDA graphs from their second run on (VRAMSHARD_FILL_GRAPHS=off: "
                     "round by round)")
        self.captures += 1
        return graph

    def round(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the coded blocks ``source`` (host) into the next half on the current stream, and decode them
        into ``out`` (int16 on the GPU) on the decode stream."""
        turn = self.rounds % 2
        self.rounds += 1
        copy_stream = torch.cuda.current_stream()
        stage = self.halves[turn][: source.numel()]
        if self._unused is None or not self._unused[turn]:
            copy_stream.wait_event(self.decoded[turn])  # the half's previous round is decoded
        if self._unused is not None:  # (a capture waits only on its own rounds: a replay follows whole fills)
            self._unused[turn] = False
        stage.copy_(source, non_blocking=True)
        self.copied[turn].record(copy_stream)
        self.stream.wait_event(self.copied[turn])
        with torch.cuda.stream(self.stream):
            decode_into(stage, out)
            self.decoded[turn].record(self.stream)
        self._last = self.decoded[turn]

    def finish(self) -> None:
        """The current stream waits for the fill's last decode (its work after sees the decoded words)."""
        if self._last is not None:
            torch.cuda.current_stream().wait_event(self._last)
            self._last = None
