"""A fake worker for scheduler policy tests (and only those).

It applies a StepRequest exactly as the real worker does -- per-request token ids and block
tables built from the new/cached diffs, K/V written into slots, one token sampled when a
request is caught up, the stop rule applied -- with a deterministic "model" in place of the
network: the sampled token is a hash of the context read back through the block table.
A slot's "K/V" is (position, checksum of every token up to it), as a real model's K/V
depend on the whole prefix; so a request recomputed after preemption, or started from a
prefix-cache hit, yields the same tokens only if the scheduler sent the right tokens and
the blocks it named hold exactly that prefix.

Swap and copy-on-write are modelled too: `cpu_cache` holds the swap space's slots, and
the step's block copies move (position, checksum) entries between the two in the order
proto/worker.proto gives (swap-out, forget/add/diff, swap-in, copies). A swapped-out
request keeps its tokens but no block table; on swap-out the fake records the checksums
its blocks held and on swap-in checks the blocks it gets back hold exactly those.

KV cache groups (`group_windows`, one window or None per group; kvstore/kv_cache_groups.py):
a request has one block table per group (the step's ids split group after group), and
every position's K/V is written into each group's slot -- as each group's layers write
their own. A group with window W reads (and so holds) only the blocks its next query's
window reaches; entries before them are holes the scheduler gave back (their ids are stale
or HOLE_BLOCK_ID). A block held by two groups, or two live requests one writes, fails.

Images (NewRequestData.mm_inputs): the "K/V" of an image's soft token depends on the
image's content hash too (the checksum takes it in), as a real model's does on the image's
embeddings, and so does the sampled token; a step whose chunk of a request starts or ends
strictly inside an image fails (the worker computes an image in one step). So a request
sent in full without its images (a child, one re-sent after preemption), or a prefix hit
serving another image's K/V, reads K/V that do not match.

It asserts that every step is consistent with the contract in proto/worker.proto, and that
no step writes into a block another live request holds (shared blocks are read-only). A
step planned ahead (after_step_id) must follow that step, and only such a step may list
a request that step finished (the fake skips it, as the worker does).
"""

import zlib
from dataclasses import dataclass

from proto import worker_pb2
from proto.pan_and_scan import embedding_key


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    block_tables: list[list[int]]  # one per KV cache group
    num_computed_tokens: int
    sampling: worker_pb2.SamplingParams
    finished: bool = False
    finished_in: int = 0  # the step that finished it
    first_read: list[int] | None = None  # the first position the step's queries read, per group
    swapped: list | None = None  # while swapped out: each group's held blocks' slot entries
    mm_inputs: tuple[tuple[str, int, int], ...] = ()  # (embedding key, offset, length) per image


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, max_num_batched_tokens: int,
                 vocab_size: int = 1000, eos_token_id: int | None = None,
                 num_cpu_blocks: int = 0, group_windows: tuple[int | None, ...] = (None,)) -> None:
        self.num_blocks = num_blocks
        self.group_windows = group_windows
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.requests: dict[str, _WorkerRequest] = {}
        # slot -> (position, checksum of the tokens up to it) last written there
        self.cache: dict[int, tuple[int, int]] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_cache: dict[int, tuple[int, int]] = {}  # CPU slot -> entry, as `cache`
        self.num_swapped_out = self.num_swapped_in = self.num_copies = 0
        self.last_step_id = 0
        self.steps: list[worker_pb2.StepRequest] = []  # every step applied, for assertions

    def _split(self, block_ids) -> list[list[int]]:
        ids, groups = list(block_ids), len(self.group_windows)
        assert len(ids) % groups == 0, f"{len(ids)} block ids for {groups} KV cache groups"
        k = len(ids) // groups
        return [ids[g * k:(g + 1) * k] for g in range(groups)]

    def _slot(self, request_id: str, req: _WorkerRequest, group: int, pos: int) -> int:
        table, index = req.block_tables[group], pos // self.block_size
        assert index < len(table), f"{request_id}: position {pos} lies beyond its {len(table)} blocks"
        return table[index] * self.block_size + pos % self.block_size

    def _first_needed(self, req: _WorkerRequest, group: int) -> int:
        """Position of the first key the request's next query sees in `group`."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, req.num_computed_tokens - window + 1)

    def _held(self, req: _WorkerRequest) -> list[list[int]]:
        """Each group's block ids its window still reaches (all of them without a window)."""
        return [table[self._first_needed(req, g) // self.block_size:]
                for g, table in enumerate(req.block_tables)]

    def step(self, step: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        assert step.step_id == self.last_step_id + 1, (
            f"step {step.step_id} after {self.last_step_id}")
        assert step.after_step_id in (0, self.last_step_id), (
            f"step {step.step_id} planned after step {step.after_step_id} runs after {self.last_step_id}")
        self.last_step_id = step.step_id
        self.steps.append(step)
        out_pairs = [(p.src, p.dst) for p in step.blocks_to_swap_out]
        self._check_pairs(out_pairs, self.num_blocks, self.num_cpu_blocks, "swap-out")
        self._copy(self.cache, self.cpu_cache, out_pairs)
        self.num_swapped_out += len(out_pairs)
        for request_id in step.swapped_out_request_ids:
            req = self.requests[request_id]
            assert req.swapped is None and not req.finished, f"{request_id} swapped out twice"
            sources = {s for s, _ in out_pairs}
            held = self._held(req)
            assert {b for ids in held for b in ids} <= sources, f"{request_id} swapped out without its blocks"
            req.swapped = [self._block_entries(self.cache, ids) for ids in held]
            req.block_tables = [[] for _ in held]
        for request_id in step.finished_request_ids:  # forgotten before anything runs
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            assert new.request_id not in self.requests, f"{new.request_id} sent in full twice"
            mm_inputs = tuple((embedding_key(m.content_hash, (m.crop.top, m.crop.left, m.crop.height, m.crop.width)
                                             if m.HasField("crop") else None), m.offset, m.length)
                              for m in new.mm_inputs)  # a crop's K/V is not its image's
            for _, offset, length in mm_inputs:
                assert 0 <= offset and offset + length <= new.num_prompt_tokens, (
                    f"{new.request_id}: image [{offset}, {offset + length}) outside its prompt")
                assert not offset < new.num_computed_tokens < offset + length, (
                    f"{new.request_id}: sent with {new.num_computed_tokens} tokens computed, inside "
                    f"image [{offset}, {offset + length})")
            self.requests[new.request_id] = _WorkerRequest(
                list(new.token_ids), new.num_prompt_tokens, self._split(new.block_ids),
                new.num_computed_tokens, new.sampling, mm_inputs=mm_inputs)
        for cached in step.cached_requests:
            req = self.requests.get(cached.request_id)
            assert req is not None, f"diff for unknown request {cached.request_id}"
            assert cached.num_computed_tokens == req.num_computed_tokens, (
                f"{cached.request_id}: scheduler counts {cached.num_computed_tokens} computed "
                f"tokens, worker {req.num_computed_tokens}")
            if cached.replace_block_ids:
                req.block_tables = self._split(cached.new_block_ids)
            else:
                assert req.swapped is None, f"{cached.request_id} resumed without a new table"
                for table, ids in zip(req.block_tables, self._split(cached.new_block_ids)):
                    table.extend(ids)
        in_pairs = [(p.src, p.dst) for p in step.blocks_to_swap_in]
        self._check_pairs(in_pairs, self.num_cpu_blocks, self.num_blocks, "swap-in")
        self._copy(self.cpu_cache, self.cache, in_pairs)
        self.num_swapped_in += len(in_pairs)
        copies = [(p.src, p.dst) for p in step.blocks_to_copy]
        self._check_pairs(copies, self.num_blocks, self.num_blocks, "copy")
        assert not {s for s, _ in copies} & {d for _, d in copies}, "copies chain"
        self._copy(self.cache, self.cache, copies)
        self.num_copies += len(copies)
        for request_id, req in self.requests.items():
            if req.swapped is not None and req.block_tables[0]:  # swapped in this step
                # (a table may end in blocks allocated for this step's tokens)
                for g, (table, swapped) in enumerate(zip(req.block_tables, req.swapped)):
                    first = self._first_needed(req, g) // self.block_size
                    entries = self._block_entries(self.cache, table[first:first + len(swapped)])
                    assert entries == swapped, (
                        f"{request_id}: group {g}'s blocks swapped in hold {entries}, swapped out {swapped}")
                req.swapped = None

        order = ([r.request_id for r in step.new_requests]
                 + [r.request_id for r in step.cached_requests])
        scheduled = dict(step.num_scheduled_tokens)
        assert sorted(order) == sorted(scheduled), "num_scheduled_tokens != new + cached requests"
        assert sum(scheduled.values()) <= self.max_num_batched_tokens, "token budget exceeded"
        holders = self._block_holders()

        finished = {rid for rid in order if self.requests[rid].finished}
        for request_id in finished:
            assert self.requests[request_id].finished_in == step.after_step_id, (
                f"{request_id} scheduled after it finished")
        order = [rid for rid in order if rid not in finished]
        return worker_pb2.StepResult(step_id=step.step_id,
                                     sampled=self._forward(step.step_id, order, scheduled, holders))

    def _forward(self, step_id: int, order: list[str], scheduled: dict[str, int],
              holders: dict[int, list[str]]) -> list[worker_pb2.SampledToken]:
        """One forward pass: K/V of the scheduled tokens written, a token sampled for
        every request it catches up."""
        written: dict[int, tuple[int, int]] = {}
        for request_id in order:
            req, num_new = self.requests[request_id], scheduled[request_id]
            assert num_new > 0, f"{request_id} scheduled for {num_new} tokens"
            end = req.num_computed_tokens + num_new
            assert end <= len(req.token_ids), f"{request_id} scheduled past its last token"
            for _, offset, length in req.mm_inputs:
                assert not (offset < req.num_computed_tokens < offset + length
                            or offset < end < offset + length), (
                    f"step {step_id}: {request_id}'s chunk [{req.num_computed_tokens}, {end}) "
                    f"splits image [{offset}, {offset + length})")
            sums = self._checksums(request_id, req)
            # what this step's first query sees, in each group
            req.first_read = [self._first_needed(req, g) for g in range(len(self.group_windows))]
            for pos in range(req.num_computed_tokens, end):
                for g in range(len(self.group_windows)):
                    slot = self._slot(request_id, req, g, pos)
                    assert slot not in written, f"slot {slot} written twice in step {step_id}"
                    block_id = slot // self.block_size
                    assert holders[block_id] == [request_id], (
                        f"{request_id} writes position {pos} into block {block_id}, "
                        f"held by {holders[block_id]}")
                    written[slot] = (pos, sums[pos])
        self.cache.update(written)

        sampled = []
        for request_id in order:
            req = self.requests[request_id]
            req.num_computed_tokens += scheduled[request_id]
            context = self._read_context(request_id, req)  # what attention reads
            if req.num_computed_tokens < len(req.token_ids):
                continue  # a partial prefill samples nothing
            token = self._token(request_id, req, context)
            req.token_ids.append(token)
            reason = self._finish_reason(req, token)
            req.finished = bool(reason)
            req.finished_in = step_id
            sampled.append(worker_pb2.SampledToken(
                request_id=request_id, token_id=token, finish_reason=reason))
        return sampled

    def _check_pairs(self, pairs, num_src: int, num_dst: int, what: str) -> None:
        for src, dst in pairs:
            assert 0 <= src < num_src and 0 <= dst < num_dst, f"{what} ({src}, {dst}) out of range"
        assert len({d for _, d in pairs}) == len(pairs), f"{what}: a destination twice: {pairs}"

    def _copy(self, src_cache: dict, dst_cache: dict, pairs) -> None:
        """Copy every slot of each block (all sources read before any destination is written)."""
        bs = self.block_size
        moved = {}
        for src, dst in pairs:
            for offset in range(bs):
                moved[dst * bs + offset] = src_cache.get(src * bs + offset)
        for slot, entry in moved.items():
            if entry is None:
                dst_cache.pop(slot, None)
            else:
                dst_cache[slot] = entry

    def _block_entries(self, cache: dict, block_ids: list[int]) -> list:
        bs = self.block_size
        return [[cache.get(b * bs + o) for o in range(bs)] for b in block_ids]

    def _checksums(self, request_id: str, req: _WorkerRequest) -> list[int]:
        """Each position's checksum of the prefix up to it (images' hashes included)."""
        return _prefix_checksums(req.token_ids, req.mm_inputs)

    def _token(self, request_id: str, req: _WorkerRequest, context: list[int]) -> int:
        """The "model": a hash of the context read back (and of the images in it)."""
        seen = (context, req.mm_inputs) if req.mm_inputs else context
        return zlib.crc32(repr(seen).encode()) % self.vocab_size

    def _read_context(self, request_id: str, req: _WorkerRequest) -> list[int]:
        """The context attention reads: every position from the step's first query's
        window on (`req.first_read`, per group) must hold its prefix's K/V."""
        sums = self._checksums(request_id, req)
        for g, first in enumerate(req.first_read):
            for pos in range(first, req.num_computed_tokens):
                entry = self.cache.get(self._slot(request_id, req, g, pos))
                assert entry == (pos, sums[pos]), (
                    f"{request_id}: group {g}'s slot for position {pos} holds {entry}, not its prefix's K/V")
        return req.token_ids[:req.num_computed_tokens]

    def _finish_reason(self, req: _WorkerRequest, token: int) -> str:
        sp = req.sampling
        num_outputs = len(req.token_ids) - req.num_prompt_tokens
        if num_outputs >= sp.min_tokens:
            if token in sp.stop_token_ids or (token == self.eos_token_id and not sp.ignore_eos):
                return "stop"
        return "length" if num_outputs >= sp.max_tokens else ""

    def _block_holders(self) -> dict[int, list[str]]:
        """Block id -> the live requests whose block tables hold it (a block in two groups'
        tables fails)."""
        holders: dict[int, list[str]] = {}
        group_of: dict[int, int] = {}
        for request_id, req in self.requests.items():
            for g, held in enumerate(self._held(req)):
                assert len(set(held)) == len(held), f"{request_id} holds a block twice: {held}"
                for block_id in held:
                    assert 0 <= block_id < self.num_blocks, (
                        f"{request_id}: block id {block_id} out of range")
                    assert group_of.setdefault(block_id, g) == g, (
                        f"block {block_id} is in groups {group_of[block_id]} and {g}")
                    holders.setdefault(block_id, []).append(request_id)
        return holders


def _prefix_checksums(token_ids: list[int], mm_inputs: tuple[tuple[str, int, int], ...] = ()) -> list[int]:
    """sums[p]: a checksum of token_ids[:p + 1] and of the images among them -- what K/V at
    position p depend on."""
    image_at = {pos: content_hash.encode() for content_hash, offset, length in mm_inputs
                for pos in range(offset, offset + length)}
    sums, crc = [], 0
    for pos, token in enumerate(token_ids):
        crc = zlib.crc32(token.to_bytes(4, "little"), crc)
        if image_at and pos in image_at:
            crc = zlib.crc32(image_at[pos], crc)
        sums.append(crc)
    return sums
