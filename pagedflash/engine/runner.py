"""ModelRunner: turns a scheduled batch into kernel metadata, runs the forward, samples.

Metadata for ``B`` rows and ``T`` packed tokens (the only things the kernels see):
``input_ids``/``positions`` int64 ``[T]``, ``slot_mapping`` int64 ``[T]``, ``cu_seqlens_q`` and
``cu_seqlens_k`` int32 ``[B + 1]`` (``k``: cached prefix plus the new tokens), ``block_tables`` int32
``[B, max_blocks]``.

Steps with prefill chunks build fresh tensors. Decode-only steps (one token per row) use persistent
buffers instead, whose block-table rows are updated incrementally (a row only receives the pages it
does not hold yet), so a step's host work does not grow with the context. On a GPU those steps
replay CUDA graphs captured for a ladder of batch sizes: ``n`` rows run in the graph of the next
size ``bs >= n``; the padding rows write nowhere (slot -1), attend one key of a valid page, and their
outputs are dropped. A graph's attention uses a fixed ``num_splits`` and ``max_seqlen_k =
max_model_len``, so it does no host sync and no data-dependent allocation. Without graphs the same
buffers feed an eager forward.

Run-ahead: a decode step whose rows are all greedy leaves its tokens on the device (the graph ends
with the LM head and an argmax) and copies them to the host behind itself, so while it runs the host
can launch the step after it (:meth:`ModelRunner.launch_ahead`; when and with which rows:
:mod:`pagedflash.engine.run_ahead`), whose input ids are those device-side tokens.

Tensor parallelism: each step has a host half (the lists above, built on rank 0 from the
scheduler's batch) and a device half (``_forward``, ``_decode_apply``, ``_ahead_apply``: tensors from
those lists, forward, logits). On rank 0 of a tensor-parallel engine, :attr:`ModelRunner.workers`
sends each device half's input to the other ranks, whose runners run the same method on it
(:mod:`pagedflash.engine.workers`); the logits are gathered on every rank, so the greedy tokens
that run-ahead feeds back on the device are the same everywhere.
"""

from __future__ import annotations

import torch

from pagedflash import validate
from pagedflash.cache import PAD_BLOCK_ID, KVCache, slot_mapping
from pagedflash.engine import layers, logprobs
from pagedflash.engine.logprobs import StepLogprobs
from pagedflash.engine.model import AttentionMetadata, CausalLM
from pagedflash.engine.sampling import sample
from pagedflash.engine.scheduler import Batch
from pagedflash.ops.utils import collector_paused, num_sms

GRAPH_BATCH_SIZES = (1, 2, 4, 8, *range(16, 257, 16), *range(288, 513, 32))
MAX_GRAPH_SPLITS = 32


class PendingTokens:
    """The tokens of a launched step: known already, or greedy tokens on their way to a pinned host
    buffer (``result`` waits for them). ``logprobs``: the step's, when a row asked (its tokens are
    then known already)."""

    def __init__(self, tokens: list[int] | None = None, *, host: torch.Tensor | None = None,
                 event: torch.cuda.Event | None = None, wait=None, logprobs: StepLogprobs | None = None):
        self._tokens, self._host, self._event = tokens, host, event
        self.logprobs = logprobs
        self._wait = wait  # waits for the event instead of event.synchronize (tensor parallel: checks the ranks)

    @property
    def deferred(self) -> bool:
        """Whether the step is still running on the device (its successor can be launched first)."""
        return self._tokens is None

    def result(self) -> list[int]:
        if self._tokens is None:
            if self._event is not None:
                if self._wait is not None:
                    self._wait(self._event)
                else:
                    self._event.synchronize()
            self._tokens = self._host.tolist()
        return self._tokens


def graph_sizes(max_rows: int) -> list[int]:
    """The batch sizes of the decode graphs captured for ``max_rows`` rows: the ladder
    :data:`GRAPH_BATCH_SIZES` below it, then ``max_rows`` itself."""
    return [b for b in GRAPH_BATCH_SIZES if b < max_rows] + [max_rows]


def graph_num_splits(batch_size: int, num_kv_heads: int, sms: int) -> int:
    """KV splits of a decode graph's attention: enough (row x KV head x split) programs to fill the
    SMs about twice, rounded up to a power of two and capped. A graph is captured for the capacity
    (``max_model_len``), not the actual lengths; the kernel divides each sequence's actual length
    among the splits, so short contexts simply leave some splits empty.

    Graphs keep this rule rather than the launcher's paged rule (``choose_num_splits``), which asks
    for more splits at batch 1 and 2 and measured slower there (see docs/performance.md, "v14 —
    decode: long tiles, split counts by page kind, a one-load combine")."""
    want = -(-2 * sms // (batch_size * num_kv_heads))
    return min(MAX_GRAPH_SPLITS, 1 << (want - 1).bit_length())


# The long prompts' step of :meth:`ModelRunner.warmup`: chunks of LONG_ROWS rows (the shortest the sm90
# Gluon prefill kernel takes), LONG_STEP rows in all (32 of its 128-row work items a query head: at
# least one a SM, as it needs, from 5 query heads a rank on 132 SMs).
LONG_ROWS, LONG_STEP = 256, 4096


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, *, max_model_len: int, max_num_seqs: int,
                 use_cuda_graphs: bool, generator: torch.Generator | None, release_hooks: list | None = None,
                 max_num_batched_tokens: int = LONG_STEP):
        self.model = model
        self.kv_caches = [kv_cache[i] for i in range(len(kv_cache))]
        model.bind_kv_scales(kv_cache)
        self.page_size = kv_cache.page_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.device = kv_cache.device
        self.generator = generator
        self.pin = self.device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if release_hooks is not None:  # graphs that capture collectives must go before their group does
            release_hooks.append(self.graphs.clear)
        self.workers = None  # rank 0 of a tensor-parallel engine: the Workers that follow each step
        # every running sequence holds a page no other holds (its last: a prompt's last page is never a
        # prefix hit, a page joins the cache only full, and a new one comes before the token that needs
        # it), so no decode step has more rows than the pool has pages: no graph for a batch that cannot come
        self._alloc_decode_buffers(min(max_num_seqs, kv_cache.num_blocks, GRAPH_BATCH_SIZES[-1]))
        if self.device.type == "cuda":
            self.warmup()
            if use_cuda_graphs:
                self.capture_graphs()

    # ------------------------------------------------------------------ one step
    def run(self, batch: Batch) -> list[int]:
        """One step: forward, logits of the rows that reached their end, one sampled token each."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: Batch) -> PendingTokens:
        """Start one step. A decode-only step whose rows are all greedy returns once its work is
        enqueued (its tokens travel to the host behind it: :meth:`PendingTokens.result` waits), so
        the host can prepare and launch the next step meanwhile (:meth:`launch_ahead`). Other steps
        sample at once.

        The kernels' device-reading metadata checks are off: this runner builds the metadata itself
        from the block manager's tables, and the checks would sync with the device in every layer.

        Rows asking for logprobs (:mod:`pagedflash.engine.logprobs`): the step samples at once, and
        its logprobs come to the host with its tokens; so no step is launched ahead after it (run-ahead
        needs deferred tokens). Steps without such rows are unchanged."""
        want = logprobs.plan(batch, self.model.config.vocab_size)  # None: no row asks
        prompt = None  # the gathered entries of want's prompt positions (logprobs.prompt)
        with validate.value_checks(False):
            if batch.is_decode_only and len(batch.rows) <= self.max_decode_rows:
                n = len(batch.rows)
                if want is not None and want.unwritten:
                    self._decode(batch, unwritten=[i for i, _ in want.unwritten])
                else:
                    self._decode(batch)
                if want is None and all(r.samples and r.seq.params.raw_greedy for r in batch.rows):
                    return self._read_greedy(n)
                logits = sample_logits = self._logits[:n]  # row i: row i's one position
                greedy = self._greedy[:n]
                if want is not None:
                    prompt = logprobs.prompt(want, logits.__getitem__, self.device)
                if not all(r.samples for r in batch.rows):  # a one-token recompute chunk samples nothing
                    keep = [i for i, r in enumerate(batch.rows) if r.samples]
                    sample_logits, greedy = logits[keep], greedy[keep]
            else:
                *args, sample_idx = self.plan(batch)
                if want is not None:
                    slots = args[2]
                    for first, count in want.unwritten:
                        slots[first : first + count] = [-1] * count
                sample_logits, prompt = self._call("_forward", *args, sample_idx, want)
                greedy = None
        rows = [r for r in batch.rows if r.samples]
        if not rows and prompt is None:
            return PendingTokens([])
        if self.workers is not None:
            self.workers.wait_device()  # sampling reads the device: wait there, watching the ranks
        if rows:
            tokens = sample(sample_logits, [r.seq.params for r in rows], [r.seq.generator for r in rows],
                            self.generator, greedy=greedy,
                            history=[r.seq.history for r in rows], grammars=[r.seq.grammar for r in rows])
        else:
            tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        if want is None:
            return PendingTokens(tokens.tolist())
        tokens, step_logprobs = logprobs.read(want, tokens, sample_logits, prompt)
        return PendingTokens(tokens, logprobs=step_logprobs)

    @torch.inference_mode()
    def launch_ahead(self, batch: Batch) -> PendingTokens:
        """Launch ``batch`` (the rows of the step just launched, in the same order, one token
        further: :class:`pagedflash.engine.run_ahead.RunAhead`) before that step's tokens reach the
        host. Its input ids are that step's greedy tokens, copied on the device; its positions and
        slots come from the host; its pages are held already (a row whose token starts a page got it
        from ``BlockManager.reserve_block``), and the table entries the device lacks go with the step."""
        n, p = len(batch.rows), self.page_size
        bs = self._graph_size(n)
        pos = [r.start for r in batch.rows]
        slots = [r.seq.block_table[r.start // p] * p + r.start % p for r in batch.rows]
        entries = self._table_entries(batch)  # a row whose token starts a page: the block reserved for it
        with validate.value_checks(False):
            self._call("_ahead_apply", n, bs, pos + [0] * (bs - n), slots + [-1] * (bs - n), entries)
        return self._read_greedy(n)

    def _ahead_apply(self, n: int, bs: int, pos: list[int], slots: list[int], table_entries: list[list[int]]) -> None:
        """Device half of :meth:`launch_ahead` (every rank): the previous step's greedy tokens as
        input ids, ``pos``/``slots`` of the ``bs`` rows (padding included), new block-table entries,
        the decode step."""
        self._meta[0, :n].copy_(self._greedy[:n])  # the previous step's tokens; padding ids stay 0
        self._meta[1:, :bs].copy_(self._pinned([pos, slots]), non_blocking=True)
        self._put_table_entries(table_entries)
        self._run_decode(n, bs, max_seqlen_k=max(pos[:n]) + 1)

    def _call(self, name: str, *args):
        """``self.name(*args)``, on every rank when this is rank 0 of a tensor-parallel engine."""
        if self.workers is not None:
            return self.workers.run(self, name, *args)
        return getattr(self, name)(*args)

    def _read_greedy(self, n: int) -> PendingTokens:
        """Enqueue the copy of this step's greedy tokens to the host (two pinned buffers in turn: the
        step launched ahead must not overwrite the one not read yet)."""
        host = self._host_tokens[self._flip][:n]
        self._flip ^= 1
        host.copy_(self._greedy[:n], non_blocking=self.pin)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingTokens(host=host, event=event, wait=self.workers.wait_event if self.workers else None)

    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.pin)
        return t.to(self.device, non_blocking=True)

    def prompt_logits(self, batch: Batch) -> torch.Tensor:
        """fp32 logits ``[T, vocab]`` of every position of ``batch``'s rows (one forward, every rank)."""
        with validate.value_checks(False):
            logits = self._call("_forward", *self.plan(batch)[:-1], None)[0].float()
        if self.workers is not None:
            self.workers.wait_device()  # the caller reads them: wait here, watching the ranks
        return logits

    def _forward(self, ids, pos, slots, cu_q, cu_k, tables, max_q, max_k, logits_idx,
                 want: logprobs.LogprobPlan | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Device half of a step with prefill rows (every rank): the forward of :meth:`plan`'s lists,
        then the logits (model dtype, gathered) of the rows ``logits_idx`` (None when it is empty,
        every row when it is None) and the gathered entries of ``want``'s prompt positions
        (:func:`logprobs.prompt`: their LM head slice by slice; None without such positions)."""
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            cu_seqlens_q=self._tensor(cu_q, torch.int32),
            cu_seqlens_k=self._tensor(cu_k, torch.int32),
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            block_tables=self._tensor(tables, torch.int32),
        )
        hidden = self.model(self._tensor(ids, torch.int64), self._tensor(pos, torch.int64), meta, self.kv_caches)
        logits = None
        if logits_idx is None:
            logits = self.model.lm_logits(hidden)
        elif logits_idx:
            rows = hidden if len(logits_idx) == hidden.shape[0] else hidden[self._tensor(logits_idx, torch.int64)]
            logits = self.model.lm_logits(rows)
        prompt = None if want is None else logprobs.prompt(want, lambda idx: self.model.lm_logits(hidden[idx]),
                                                           self.device, read=self.model.shard.rank == 0)
        return logits, prompt

    def plan(self, batch: Batch):
        """The host half of a step with prefill rows: plain lists (input ids, positions, slots,
        cu_seqlens q and k, padded block tables), the longest query and key lengths, and the packed
        rows whose logits sample."""
        p = self.page_size
        ids, pos, slots, cu_q, cu_k, tables, logits_idx = [], [], [], [0], [0], [], []
        for row in batch.rows:
            seq = row.seq
            ids += seq.token_ids[row.start : row.end]
            pos += range(row.start, row.end)
            slots += slot_mapping(seq.block_table, row.start, row.end, page_size=p)
            cu_q.append(cu_q[-1] + row.num_tokens)
            cu_k.append(cu_k[-1] + row.end)
            tables.append(seq.block_table[: -(-row.end // p)])
            if row.samples:
                logits_idx.append(cu_q[-1] - 1)
        width = max(len(t) for t in tables)
        tables = [t + [PAD_BLOCK_ID] * (width - len(t)) for t in tables]
        max_q, max_k = max(r.num_tokens for r in batch.rows), max(r.end for r in batch.rows)
        return ids, pos, slots, cu_q, cu_k, tables, max_q, max_k, logits_idx

    @torch.inference_mode()
    def warmup(self, lengths: tuple[int, ...] = tuple(1 << i for i in range(14))) -> None:
        """Compile, before the first request, every kernel variant a step can need, so that no
        request waits for the JIT: the attention launch's tile depends on the step's longest query
        chunk (GQA packing below ``PACK_MAX_ROWS`` rows) and on whether the KV range is split, the
        fused kernels and the batch-invariant projections (:func:`pagedflash.ops.matmul.rows_tile`)
        on the token count, and long prompts' chunks take the Gluon prefill kernel on sm90. One
        forward per chunk length of ``lengths`` (powers of two to 8,192, which meet every tile of
        the 1B, 8B and Qwen3-1.7B shapes' projections; at most the step budget and the model
        length), split and not, then one of :data:`LONG_STEP` rows in chunks of :data:`LONG_ROWS`
        (as many as the step budget and ``max_num_seqs`` allow). Their K/V writes go nowhere (slot
        -1) and their pages are page 0, read only."""
        with validate.value_checks(False):
            for q_len in sorted({min(n, self.max_model_len, self.max_num_batched_tokens) for n in lengths}):
                for splits in (1, 2):
                    self._warm_step(q_len, 1, splits)
            seqs = min(min(LONG_STEP, self.max_num_batched_tokens) // LONG_ROWS, self.max_num_seqs)
            if LONG_ROWS <= self.max_model_len and seqs > 0:
                self._warm_step(LONG_ROWS, seqs, 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_step(self, q_len: int, num_seqs: int, splits: int) -> None:
        """One forward of ``num_seqs`` fresh sequences of ``q_len`` tokens each (writes to slot -1,
        every page page 0)."""
        dev, total = self.device, q_len * num_seqs
        cu = torch.arange(0, total + 1, q_len, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev), cu_seqlens_q=cu, cu_seqlens_k=cu,
            max_seqlen_q=q_len, max_seqlen_k=q_len, num_splits=splits,
            block_tables=torch.zeros((num_seqs, -(-q_len // self.page_size)), dtype=torch.int32, device=dev),
        )
        positions = torch.arange(q_len, device=dev).repeat(num_seqs)
        self.model(torch.zeros(total, dtype=torch.int64, device=dev), positions, meta, self.kv_caches)

    # ------------------------------------------------------------------ decode-only steps
    def _alloc_decode_buffers(self, rows: int) -> None:
        dev = self.device
        self.max_decode_rows = rows
        # token id, position and cache slot of each row: one [3, rows] buffer, filled by one copy a step
        self._meta = torch.zeros((3, rows), dtype=torch.int64, device=dev)
        self._ids, self._pos, self._slots = self._meta
        self._cu_q = torch.arange(rows + 1, dtype=torch.int32, device=dev)  # one query per row, fixed
        self._cu_k = torch.arange(rows + 1, dtype=torch.int32, device=dev)  # from the positions, on the device
        max_pages = -(-self.max_model_len // self.page_size)
        self._tables = torch.full((rows, max_pages), PAD_BLOCK_ID, dtype=torch.int32, device=dev)
        self._held: list[tuple] = [()] * rows  # what each table row holds: (seq_id, num_preemptions, pages)
        lm = self.model.lm_head.weight  # with several ranks this rank's vocabulary rows; the logits are whole
        self._logits = torch.zeros(rows, self.model.config.vocab_size, dtype=lm.dtype, device=dev)
        self._greedy = torch.zeros(rows, dtype=torch.int64, device=dev)
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=self.pin) for _ in range(2)]
        self._flip = 0

    def forget_decode_tables(self) -> None:
        """After a failed step: assume no block-table row holds anything, so the next decode step
        writes each row whole (a step that failed may have recorded rows it never copied)."""
        self._held = [()] * self.max_decode_rows

    def _decode(self, batch: Batch, unwritten: tuple[int, ...] | list[int] = ()) -> None:
        """Fill the persistent buffers for ``n`` decode rows (padded to the graph's size) and run the
        forward, the LM head and the greedy argmax (into ``_logits[:n]``, ``_greedy[:n]``). The rows
        ``unwritten`` write no K/V (positions recomputed inside a shared page, for prompt logprobs).

        Host work per step: one host-to-device copy of the rows' ids, positions and slots (padding
        rows: id 0, position 0, slot -1, so they write nowhere and attend one key of their row's page),
        one more for block-table entries when a row got a page, the graph launch, one token read."""
        n, p = len(batch.rows), self.page_size
        bs = self._graph_size(n)
        ids = [row.seq.token_ids[row.start] for row in batch.rows]
        pos = [row.start for row in batch.rows]
        slots = [row.seq.block_table[row.start // p] * p + row.start % p for row in batch.rows]
        for i in unwritten:
            slots[i] = -1
        pad = [0] * (bs - n)
        self._call("_decode_apply", n, bs, [ids + pad, pos + pad, slots + [-1] * (bs - n)],
                   self._table_entries(batch), max(r.end for r in batch.rows))

    def _table_entries(self, batch: Batch) -> list[list[int]]:
        """The block-table entries (rows, columns, page ids) the device's tables lack for ``batch``'s
        rows, by what :attr:`_held` records of each row; records them as held."""
        p = self.page_size
        t_rows, t_cols, t_vals = [], [], []
        for i, row in enumerate(batch.rows):
            seq = row.seq
            pages = -(-row.end // p)
            held = self._held[i]
            first = held[2] if held[:2] == (seq.seq_id, seq.num_preemptions) and held[2] <= pages else 0
            t_rows += [i] * (pages - first)
            t_cols += range(first, pages)
            t_vals += seq.block_table[first:pages]
            self._held[i] = (seq.seq_id, seq.num_preemptions, pages)
        return [t_rows, t_cols, t_vals]

    def _decode_apply(self, n: int, bs: int, meta: list[list[int]], table_entries: list[list[int]],
                      max_seqlen_k: int) -> None:
        """Device half of :meth:`_decode` (every rank): the rows' ids, positions and slots (padding
        included), the new block-table entries (rows, columns, page ids), the decode step."""
        self._meta[:, :bs].copy_(self._pinned(meta), non_blocking=True)
        self._put_table_entries(table_entries)
        self._run_decode(n, bs, max_seqlen_k=max_seqlen_k)

    def _put_table_entries(self, table_entries: list[list[int]]) -> None:
        if table_entries[0]:
            rows_t, cols_t, vals_t = self._pinned(table_entries).to(self.device, non_blocking=True)
            self._tables.index_put_((rows_t, cols_t), vals_t.to(torch.int32))

    def _graph_size(self, n: int) -> int:
        """The captured batch size that serves ``n`` rows (``n`` itself when none does)."""
        return next((b for b in sorted(self.graphs) if b >= n), n)

    def _run_decode(self, n: int, bs: int, *, max_seqlen_k: int) -> None:
        """Replay the graph of size ``bs``, or run the same body eagerly for the ``n`` rows."""
        graph = self.graphs.get(bs)  # read once: a tensor-parallel watchdog may clear the graphs
        if graph is not None:
            graph.replay()
        else:  # an upper bound is all attention needs: rounded up, 16 steps share one launch plan
            max_seqlen_k = min(self.max_model_len, -(-max_seqlen_k // 16) * 16)
            self._decode_step(n, self._decode_meta(n, max_seqlen_k=max_seqlen_k, num_splits=0))

    def _pinned(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, pin_memory=self.pin)

    def _decode_step(self, bs: int, meta: AttentionMetadata) -> None:
        """The body of a decode graph (or an eager decode step): sequence ends from the positions,
        forward, LM head into ``_logits``, greedy tokens into ``_greedy``."""
        torch.cumsum(self._pos[:bs] + 1, 0, dtype=torch.int32, out=self._cu_k[1 : bs + 1])
        x, residual = self.model.forward_unnormed(self._ids[:bs], self._pos[:bs], meta, self.kv_caches)
        self.model.logits_into(x, residual, self._logits[:bs])
        self._greedy[:bs] = layers.argmax(self._logits[:bs])

    def _decode_meta(self, bs: int, *, max_seqlen_k: int, num_splits: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._slots[:bs], cu_seqlens_q=self._cu_q[: bs + 1], cu_seqlens_k=self._cu_k[: bs + 1],
            max_seqlen_q=1, max_seqlen_k=max_seqlen_k, block_tables=self._tables[:bs], num_splits=num_splits,
        )

    def capture_graphs(self) -> None:
        """Capture one graph per batch size of the ladder up to ``max_decode_rows``, garbage collected
        first and the collector paused until the last (:func:`~pagedflash.ops.utils.collector_paused`:
        a dropped engine's graphs destroyed mid-capture would invalidate it)."""
        sizes = graph_sizes(self.max_decode_rows)
        sms = num_sms(self.device)
        pool = None
        with torch.inference_mode(), validate.value_checks(False), collector_paused():  # no syncs in warm-ups either
            for bs in reversed(sizes):  # largest first: the smaller graphs reuse its memory pool
                meta = self._decode_meta(bs, max_seqlen_k=self.max_model_len,
                                         num_splits=graph_num_splits(bs, self.model.shard.num_kv_heads, sms))
                self.graphs[bs], pool = capture(lambda bs=bs, meta=meta: self._decode_step(bs, meta), pool)


def capture(body, pool):
    """Run ``body`` once (compiles the kernels), then capture it into a CUDA graph sharing ``pool``.
    Returns ``(graph, pool)``; ``graph.replay()`` reruns the body's kernels on the same buffers."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    torch.cuda.synchronize()
    return graph, graph.pool() if pool is None else pool
