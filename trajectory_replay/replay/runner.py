"""The replay runner: plans (`replay.plan`), then executes the plan's passes and reports.

Execution follows the plan and decides nothing about ranks or selection: each pass runs the
sample-level stages once over its rows, then each cohort-level stage once per part, and every
verdict is reported for the ranks the plan names. Loaded payloads and stage outputs are dropped as
soon as no later stage reads them.

A large pass streams (`replay.blocks`): every stage runs over one block of whole groups, then over the
next, while a second thread reads the next block's payloads and runs its sample-level stages (when a CPU is
free for it: `cpus.free_cpus`); each stage's verdict is made once, from its runs over the blocks, and equals
that of one run over the whole cohort.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from trajectory_replay._allocator import reuse_block_buffers
from trajectory_replay.bundle.schema import STAGE_ORDER, StageId
from trajectory_replay.bundle.stage_io import STAGE_IO, Setting
from trajectory_replay.cpus import one_core_for_cpu_work, threads_for
from trajectory_replay.replay.blocks import BLOCK_TOKENS, STREAM_TOKENS, Block, Merged, plan_blocks, whole_block
from trajectory_replay.replay.cohort import Cohort, PayloadCache
from trajectory_replay.replay.compare import StageChecks, resolve_tolerance
from trajectory_replay.replay.estimators import Whitening
from trajectory_replay.replay.kernels import Moments, sample_moments, whiten, whitening_stats
from trajectory_replay.replay.plan import Pass, PlannedStage, ReplayPlan, plan_replay
from trajectory_replay.replay.registry import BUILTIN
from trajectory_replay.replay.report import ReplayReport, StageResult, skipped
from trajectory_replay.replay.selection import Selection
from trajectory_replay.replay.source import ReplaySource, reading_ahead
from trajectory_replay.replay.stages import Outputs, Stage, StageContext, StageOutcome


def replay(
    sources: Sequence[ReplaySource],
    *,
    samples: Sequence[str] = (),
    groups: Sequence[str] = (),
    batches: Sequence[str] = (),
    stages: Sequence[str | StageId] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    rank: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    block_tokens: int | None = None,
) -> ReplayReport:
    """Replay one bundle (one source per rank) and report every stage and the first divergence;
    with `rank`, only that rank of it (the selection then picks among that rank's samples); with `overrides`,
    under the recorded config with those fields changed (the report lists them). `block_tokens`: stream the
    replay in blocks of whole groups of about that many tokens (default: only a cohort of more than
    `blocks.STREAM_TOKENS` tokens streams, in blocks of `blocks.BLOCK_TOKENS`); the report is the same."""
    plan = plan_replay(
        sources, Selection(tuple(samples), tuple(groups), tuple(batches)), stages=stages, rank=rank, overrides=overrides
    )
    return execute(plan, atol=atol, rtol=rtol, block_tokens=block_tokens)


def execute(
    plan: ReplayPlan, *, atol: float | None = None, rtol: float | None = None, block_tokens: int | None = None
) -> ReplayReport:
    """Run `plan`: every pass, its verdicts in stage order, rank by rank."""
    return execute_keeping(plan, (), atol=atol, rtol=rtol, block_tokens=block_tokens)[0]


PER_SAMPLE_OUTPUTS = tuple(name for io in STAGE_IO.values() if io.per == "sample" for name in io.outputs)
"""Stage outputs with one value per sample; every other output a stage hands on has one per token."""


def execute_keeping(
    plan: ReplayPlan,
    keep: Sequence[str],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    block_tokens: int | None = None,
) -> tuple[ReplayReport, dict[str, dict[str, torch.Tensor]]]:
    """`execute`, also handing back the recomputed outputs named in `keep` (of the sample-level stages that ran),
    as {output: {sample_id: the sample's values}}: what a chained replay links a step's inputs to."""
    runner = _PassRunner(plan, atol, rtol, keep, block_tokens)
    results = [result for one in plan.passes for result in runner.one_pass(one)]
    order = {stage.value: i for i, stage in enumerate(STAGE_ORDER)}
    results.sort(key=lambda r: (order.get(r.stage, len(order)), -1 if r.rank is None else r.rank))
    requested = tuple(p.stage.id.value for p in plan.stages if p.named)
    return ReplayReport(
        bundle_id=plan.bundle_id, stages=tuple(results), overrides=dict(plan.overrides), requested=requested
    ), runner.kept


Runs = list[tuple[StageOutcome, Block]]
StageOutputs = dict[StageId, Outputs]
"""What the stages that ran hand on, by stage: the outputs the later stages read."""


@dataclass
class _PassState:
    """One pass under way: its rows, the blocks it runs in, and what its stages produced so far."""

    plan: Pass
    whole: Cohort
    blocks: list[Block]
    runs: dict[StageId, Runs] = field(default_factory=dict)
    """Each sample-level stage's runs over the blocks (its outcomes without their outputs)."""
    part_runs: dict[tuple[StageId, int], Runs] = field(default_factory=dict)
    """Each cohort-level stage's runs over the blocks, per part of the cohort."""
    shared: StageOutputs = field(default_factory=dict)
    """The outputs of the stages that run once over the whole cohort (per-sample values)."""
    whitening: Whitening | None = None
    """The cohort's whitening of the advantages, for a streamed pass whose estimator whitens over the cohort."""

    @property
    def streamed(self) -> bool:
        return len(self.blocks) > 1


class _PassRunner:
    """Runs the passes of one replay plan; holds what they share: the plan, the tolerance overrides, the payload
    cache, and the recomputed outputs kept for the caller."""

    def __init__(
        self,
        plan: ReplayPlan,
        atol: float | None,
        rtol: float | None,
        keep: Sequence[str] = (),
        block_tokens: int | None = None,
    ) -> None:
        self.plan, self.atol, self.rtol = plan, atol, rtol
        self.keep = frozenset(keep)
        self.kept: dict[str, dict[str, torch.Tensor]] = {}
        self.cache = PayloadCache()
        self.block_tokens = block_tokens
        self.contracted = frozenset(plan.reference.manifest.stage_contracts)
        self.sample_level = [p for p in plan.stages if not p.stage.cohort_level]
        self.cohort_level = [p for p in plan.stages if p.stage.cohort_level]

    def context(
        self,
        stage: StageId,
        cohort: Cohort,
        outputs: StageOutputs,
        rank: int | None,
        block: Block | None = None,
        whitening: Whitening | None = None,
    ) -> StageContext:
        reference = self.plan.reference
        return StageContext(
            cohort=cohort,
            config=self.plan.config,
            tol=resolve_tolerance(reference.manifest, stage, self.atol, self.rtol),
            contracted=self.contracted,
            outputs=outputs,
            rank=rank,
            kernels=self.plan.kernels,
            block=block,
            whitening=whitening,
        )

    def blocks(self, whole: Cohort) -> list[Block]:
        """The blocks a pass over `whole` runs in: one, unless the cohort is large (or `block_tokens` was given) and
        can be streamed exactly."""
        limit = self.block_tokens
        if limit is None:
            if whole.num_tokens <= STREAM_TOKENS:
                return [whole_block(whole)]
            limit = BLOCK_TOKENS
        if not self._streamable(whole):
            return [whole_block(whole)]
        return plan_blocks(whole, limit)

    def _streamable(self, whole: Cohort) -> bool:
        """A cohort streams when every per-token payload holds exactly its tokens (a malformed bundle is replayed
        in one piece, where every size problem is reported as it is) and its estimator, if it whitens over the
        cohort, is a built-in one (which takes the cohort's statistics from the first pass)."""
        for part in whole.parts:
            tokens = sum(r.response_length for r in part.source.index.samples)
            if any(r.response_length < 0 for r in part.source.index.samples):
                return False
            for spec in part.source.manifest.payloads.values():
                if spec.per_token and math.prod(spec.shape) != tokens:
                    return False
        estimator = self.plan.kernels.estimator
        return not estimator.whitened or BUILTIN.get(estimator.name) is estimator

    def one_pass(self, plan: Pass) -> list[StageResult]:
        """The verdicts of one pass: sample-level stages over all its rows, then cohort-level ones per part; in
        blocks of whole groups when the pass streams (every stage over one block, then the next, with the next
        block read ahead, as its sources see fit for that (`source.reading_ahead`), when there is a CPU free for
        it). Torch's operations run on the CPUs free now (`cpus.threads_for`), less the one reading ahead."""
        whole = Cohort(plan.parts, self.cache)
        blocks = self.blocks(whole)
        cpus = threads_for(torch.get_num_threads())
        # reading ahead on the CPU torch's threads run on would only take turns with them (and their interpreter lock)
        ahead = len(blocks) > 1 and cpus >= 2
        sources = [part.source for part in plan.parts]
        arena = _arena_bytes(blocks, plan, self._block_payloads(plan)) if ahead else 0
        reading = reading_ahead(sources, arena) if ahead else nullcontext()
        with (
            _kernel_threads(cpus - 1 if ahead else cpus),
            one_core_for_cpu_work() if cpus == 1 else nullcontext(),
            reading,
        ):
            return self._pass(_PassState(plan, whole, blocks), ahead)

    def _pass(self, state: _PassState, read_ahead: bool) -> list[StageResult]:
        """Run every stage of the pass over its blocks, then make each stage's verdict from its runs."""
        self._run_once_over_cohort(state)
        if state.streamed:
            state.whitening = self._whitening(state.plan, state.blocks, state.shared)
        self._run_blocks(state, read_ahead)
        return self._sample_level_verdicts(state) + self._cohort_level_verdicts(state)

    def _run_once_over_cohort(self, state: _PassState) -> None:
        """The sample-level stages that do not run block by block, once over the whole cohort."""
        for planned in self.sample_level:
            if not planned.stage.per_block and self._runs(planned, state.plan):
                ctx = self.context(planned.stage.id, state.whole, state.shared, state.plan.label)
                self._compute(planned, ctx, state.shared, state.runs, whole_block(state.whole))

    def _sample_steps(self, state: _PassState, block: Block) -> tuple[StageOutputs, list[Callable[[], None]]]:
        """The block's per-block sample-level stages as steps to run in order, and the outputs they fill (what the
        cohort-level stages read)."""
        shared = state.shared
        outputs: StageOutputs = (
            _block_outputs(shared, block) if state.streamed else {k: dict(v) for k, v in shared.items()}
        )
        return outputs, [
            functools.partial(self._sample_step, state, block, outputs, i) for i in range(len(self.sample_level))
        ]

    def _sample_step(self, state: _PassState, block: Block, outputs: StageOutputs, i: int) -> None:
        """The `i`th sample-level stage over the block, if it runs block by block; then what no later stage reads
        is dropped."""
        planned = self.sample_level[i]
        if planned.stage.per_block and self._runs(planned, state.plan):
            ctx = self.context(
                planned.stage.id,
                block.cohort,
                outputs,
                state.plan.label,
                block if state.streamed else None,
                state.whitening,
            )
            self._compute(planned, ctx, outputs, state.runs, block)
        later = [p.stage for p in self.sample_level[i + 1 :] + self.cohort_level]
        _release(outputs, block.cohort.cache, later, self.plan.setting)

    def _run_blocks(self, state: _PassState, read_ahead: bool) -> None:
        """Every block in turn: its sample-level stages (by the worker ahead as far as it got, when reading ahead),
        then its cohort-level stages, per part."""
        sample_steps = functools.partial(self._sample_steps, state)
        ahead = _NextBlockWorker(state.blocks, sample_steps, self._block_payloads(state.plan)) if read_ahead else None
        heap = reuse_block_buffers() if state.streamed else None
        try:
            for b, block in enumerate(state.blocks):
                # block b's payloads read and its sample-level stages run, by the thread ahead as far as it got
                # and here for the rest; that thread goes on to block b + 1 while the cohort-level stages run here
                if ahead is not None:
                    outputs = ahead.take(b)
                else:
                    outputs, steps = sample_steps(block)
                    for run_step in steps:
                        run_step()
                for planned in self.cohort_level:
                    if planned.action == "run" and not state.plan.cohort_skip:
                        self._per_part(
                            planned, state.plan, state.whole, block, outputs, state.part_runs, state.streamed
                        )
                if state.streamed:
                    block.cohort.cache.retain(set())
                if ahead is not None:
                    ahead.done(b, block.cohort.cache.names)
                if heap is not None:
                    heap.between_blocks()
        finally:  # a read or a stage that fails leaves no thread behind
            if ahead is not None:
                ahead.close()
            if heap is not None:
                heap.end()

    def _sample_level_verdicts(self, state: _PassState) -> list[StageResult]:
        """Each sample-level stage's verdict (and its copies for the replica ranks), from its runs in block order."""
        plan, whole = state.plan, state.whole
        position = {id(block): b for b, block in enumerate(state.blocks)}
        results: list[StageResult] = []
        for planned in self.sample_level:
            if planned.action == "run" and planned.stage.id in state.runs:
                # in block order: the thread ahead may run a stage on the next block before this one ends it
                stage_runs = sorted(state.runs[planned.stage.id], key=lambda run: position.get(id(run[1]), -1))
                result = planned.stage.verdict(
                    self.context(planned.stage.id, whole, {}, plan.label), _merged(stage_runs, whole), stage_runs
                )
            elif planned.action == "run":  # whitened advantages on part of the cohort
                result = skipped(
                    planned.stage.id.value, f"{WHITENED_PART} ({self.plan.kernels.estimator.name})", plan.label
                )
            else:
                result = skipped(planned.stage.id.value, planned.reason, plan.label)
            results += _with_copies(result, plan.label, plan.copies)
        return results

    def _cohort_level_verdicts(self, state: _PassState) -> list[StageResult]:
        """Each cohort-level stage's verdict per part (and its copies for the part's replica ranks)."""
        plan = state.plan
        results: list[StageResult] = []
        for planned in self.cohort_level:
            if planned.action != "run" or plan.cohort_skip:
                result = skipped(planned.stage.id.value, planned.reason or plan.cohort_skip, plan.label)
                results += _with_copies(result, plan.label, plan.copies)
                continue
            for k, ranks in enumerate(plan.cohort_ranks):
                if ranks:
                    part = state.whole.part(k)
                    stage_runs = state.part_runs.get((planned.stage.id, k), [])
                    result = planned.stage.verdict(
                        self.context(planned.stage.id, part, {}, ranks[0]), _merged(stage_runs, part), stage_runs
                    )
                    results += _with_copies(result, ranks[0], ranks[1:])
        return results

    def _block_payloads(self, plan: Pass) -> set[str]:
        """The payloads the stages that run block by block may read under the config: what the thread ahead reads
        for a block before its stages run (one a stage loads beyond these is read when it asks, and ahead for the
        blocks after)."""
        running = [p for p in self.sample_level if p.stage.per_block and self._runs(p, plan)]
        running += [p for p in self.cohort_level if p.action == "run" and not plan.cohort_skip]
        return {name for p in running for name in p.stage.io.payloads_read_under(self.plan.setting)}

    def _runs(self, planned: PlannedStage, plan: Pass) -> bool:
        """True when the stage computes (or hands recorded outputs downstream) in this pass."""
        if planned.action == "skip":
            return False
        return not (planned.action == "run" and not plan.whole and self._whitened(planned.stage.id))

    def _compute(
        self, planned: PlannedStage, ctx: StageContext, outputs: StageOutputs, runs: dict[StageId, Runs], block: Block
    ) -> None:
        """Run one planned stage over the context's rows (or hand its recorded outputs on); keep its outcome."""
        stage = planned.stage
        if planned.action == "recorded":
            assert stage.recorded is not None  # the plan hands recorded outputs on only for a stage that has them
            outputs[stage.id] = stage.recorded(ctx)
            return
        assert stage.compute is not None  # the plan runs only a stage replay can compute
        outcome = stage.compute(ctx)
        if outcome.outputs:
            outputs[stage.id] = outcome.outputs
        if self.keep:
            self._keep(outcome.outputs, ctx.cohort)
        # the verdict needs the findings, not the per-token outputs: those go when no later stage reads them
        runs.setdefault(stage.id, []).append((replace(outcome, outputs={}), block))

    def _per_part(
        self,
        planned: PlannedStage,
        plan: Pass,
        whole: Cohort,
        block: Block,
        outputs: StageOutputs,
        part_runs: dict[tuple[StageId, int], Runs],
        streamed: bool,
    ) -> None:
        """A cohort-level stage over the block's rows of each part, with the block's slice of the (per-token)
        upstream outputs it consumes; its verdict is made per part once every block ran."""
        for k, ranks in enumerate(plan.cohort_ranks):
            found = block.part(k, whole) if ranks else None
            if found is None:
                continue
            part_block, tokens = found
            part_outputs: StageOutputs = {
                stage: {key: value[tokens] for key, value in produced.items()}
                for stage, produced in outputs.items()
                if stage in planned.stage.io.upstream_stages
            }
            ctx = self.context(
                planned.stage.id, part_block.cohort, part_outputs, ranks[0], part_block if streamed else None
            )
            assert planned.stage.compute is not None  # the plan runs only a stage replay can compute
            outcome = planned.stage.compute(ctx)
            part_runs.setdefault((planned.stage.id, k), []).append((outcome, part_block))

    def _whitening(self, plan: Pass, blocks: list[Block], shared: StageOutputs) -> Whitening | None:
        """For a streamed pass whose estimator whitens over the cohort: a first pass over the blocks collects every
        sample's moments of the advantages before whitening, and the cohort's statistics whiten every block."""
        estimate = next((p for p in self.sample_level if p.stage.id == StageId.ADVANTAGE_ESTIMATE), None)
        if (
            estimate is None
            or estimate.action != "run"
            or not self._whitened(StageId.ADVANTAGE_ESTIMATE)
            or not plan.whole
        ):
            return None
        n = sum(len(b.index) for b in blocks)
        moments = Moments(*(torch.zeros(n, dtype=torch.float64) for _ in range(3)))
        for block in blocks:

            def collect(
                values: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, at: torch.Tensor = block.index
            ) -> torch.Tensor:
                found = sample_moments(values, mask, lengths)
                moments.count[at], moments.total[at], moments.m2[at] = found.count, found.total, found.m2
                return values

            outputs = _block_outputs(shared, block)
            upstream = [
                p
                for p in self.sample_level
                if p.stage.per_block
                and p.stage.id != StageId.SAMPLE
                and STAGE_ORDER.index(p.stage.id) <= STAGE_ORDER.index(StageId.ADVANTAGE_ESTIMATE)
            ]
            for planned in upstream:
                if self._runs(planned, plan):
                    ctx = self.context(planned.stage.id, block.cohort, outputs, plan.label, block, collect)
                    self._compute(planned, ctx, outputs, {}, block)
            block.cohort.cache.retain(set())
        mean, var = whitening_stats(moments)
        return lambda values, mask, lengths: whiten(values, mean, var)

    def _keep(self, produced: Mapping[str, torch.Tensor], cohort: Cohort) -> None:
        """Split the kept outputs a stage recomputed into each sample's values."""
        for name in self.keep & set(produced):
            values = produced[name].reshape(-1)
            if name in PER_SAMPLE_OUTPUTS:
                rows = torch.split(values, 1)
            else:
                rows = torch.split(values, cohort.lengths.tolist())
            self.kept.setdefault(name, {}).update(zip(cohort.sample_ids, rows))

    def _whitened(self, stage: StageId) -> bool:
        """True for advantage.estimate of an estimator that whitens over the whole cohort."""
        return stage == StageId.ADVANTAGE_ESTIMATE and self.plan.kernels.estimator.whitened


class _BlockJob:
    """One block's work ahead: read its payloads, then its sample-level stages, as steps run strictly in order.
    The thread ahead runs steps until the caller takes the block; the caller then waits for the step under way
    and runs the rest itself. So neither thread idles while the other has work on the block: the split between
    reading-plus-early-stages and the later stages balances itself, block by block."""

    def __init__(self, outputs: StageOutputs, steps: Sequence[Callable[[], None]]) -> None:
        self.outputs = outputs
        self.steps = list(steps)
        self.next = 0
        self.taken = False
        self.running = False
        self.error: BaseException | None = None
        self.turn = threading.Condition()

    def run_ahead(self) -> None:
        """On the thread ahead: the steps in order, until all ran, one failed, or the caller took the block."""
        while True:
            with self.turn:
                if self.taken or self.error is not None or self.next == len(self.steps):
                    return
                self.running = True
            try:
                self.steps[self.next]()
            except BaseException as exc:  # handed to the caller, which raises it
                self.error = exc
            finally:
                with self.turn:
                    if self.error is None:
                        self.next += 1
                    self.running = False
                    self.turn.notify_all()

    def finish(self) -> StageOutputs:
        """On the caller's thread: take the block, wait for the step under way, run the remaining ones."""
        with self.turn:
            self.taken = True
            while self.running:
                self.turn.wait()
        if self.error is not None:
            raise self.error
        while self.next < len(self.steps):
            self.steps[self.next]()
            self.next += 1
        return self.outputs


class _NextBlockWorker:
    """Works one block ahead of the caller, on a thread of its own: reads the next block's payloads and runs its
    sample-level stages (a `_BlockJob`) while the caller runs the cohort-level stages (the losses) over the block
    before. Reading and verifying (file reads, BLAKE3) and the stage chain run at the same time, on two cores.
    It starts on the first block at once, reading the payloads the stages may read under the config (`names`);
    a payload a block's stages loaded beyond those is read ahead for the blocks after."""

    def __init__(
        self,
        blocks: Sequence[Block],
        sample_steps: Callable[[Block], tuple[StageOutputs, list[Callable[[], None]]]],
        names: set[str],
    ) -> None:
        self.blocks = blocks
        self.sample_steps = sample_steps
        self.names: set[str] = set(names)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-ahead")
        self.jobs: dict[int, _BlockJob] = {}
        self.started: set[int] = set()
        self._start(0)

    def take(self, b: int) -> StageOutputs:
        """Block `b`'s sample-level outputs, its stages run (a read or stage error surfaces here); the thread ahead
        goes on to block b + 1."""
        job = self.jobs.pop(b, None)
        if job is None:  # nothing to read ahead: the block runs here
            outputs, steps = self.sample_steps(self.blocks[b])
            job = _BlockJob(outputs, steps)
        self._start(b + 1)  # queued behind block b: it begins once the thread ahead lets go of block b
        return job.finish()

    def done(self, b: int, names: set[str]) -> None:
        """Block `b` ran, loading `names`: those are read ahead from now on, starting with block b + 1."""
        self.names |= names
        self._start(b + 1)

    def _start(self, i: int) -> None:
        if self.names and i < len(self.blocks) and i not in self.started:
            self.started.add(i)
            block, names = self.blocks[i], sorted(self.names)
            outputs, steps = self.sample_steps(block)
            job = self.jobs[i] = _BlockJob(outputs, [functools.partial(_read, block, names), *steps])
            self.pool.submit(self._ahead, job)

    @staticmethod
    def _ahead(job: _BlockJob) -> None:
        with one_core_for_cpu_work():  # the core `_kernel_threads` left: local reads stay on it
            job.run_ahead()

    def close(self) -> None:
        for job in self.jobs.values():
            with job.turn:
                job.taken = True  # a job not yet begun stops before its first step
        self.pool.shutdown(wait=True)


def _read(block: Block, names: Sequence[str]) -> None:
    """Read the block's rows of the payloads `names` into its cache."""
    for part in block.cohort.parts:
        for name in names:
            if part.source.has_payload(name):
                block.cohort.cache.load(part, name)


def _arena_bytes(blocks: Sequence[Block], plan: Pass, names: set[str]) -> int:
    """Room for the payloads `names` of three of the largest blocks: the block the stages run on, the next one read
    meanwhile, and slack for the arena's free space to come in pieces."""
    per_token = 0.0
    for part in plan.parts:
        specs = part.source.manifest.payloads
        per_token = max(
            per_token,
            sum(
                spec.size / max(math.prod(spec.shape), 1)
                for name, spec in specs.items()
                if name in names and spec.per_token
            ),
        )
    tokens = max(block.cohort.num_tokens for block in blocks)
    return min(int(3 * tokens * per_token) + (16 << 20), MAX_ARENA)


MAX_ARENA = 4 << 30
"""The largest arena a streamed pass asks for (blocks beyond it are read into memory of their own)."""


@contextmanager
def _kernel_threads(threads: int) -> Iterator[None]:
    """Torch's operations on `threads` threads within it. A parallel operation waits for its slowest part: on more
    threads than there are CPUs free (a busy reader beside them on a host with two cores, or another process),
    each call waits for a descheduled part, and a replay took several times longer than on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        yield
    finally:
        torch.set_num_threads(before)


WHITENED_PART = "advantages whitened over the whole cohort are not replayable on part of it"


def _block_outputs(shared: StageOutputs, block: Block) -> StageOutputs:
    """The block's samples' values of the per-sample outputs computed once over the whole cohort."""
    return {stage: {key: value[block.index] for key, value in produced.items()} for stage, produced in shared.items()}


def _merged(runs: Runs, whole: Cohort) -> StageChecks:
    """The findings of a stage's runs over blocks, as over the whole cohort."""
    merged = Merged()
    for outcome, block in runs:
        merged.add(outcome.findings, block)
    return merged.findings(whole)


def _with_copies(result: StageResult, source_rank: int | None, replicas: Sequence[int | None]) -> list[StageResult]:
    """`result`, and the same verdict for every replica rank (its data is identical to `source_rank`'s)."""
    message = f"{result.message} (data identical to rank {source_rank})".lstrip()
    return [result] + [replace(result, rank=r, message=message) for r in replicas]


def _release(outputs: StageOutputs, cache: PayloadCache, later: Sequence[Stage], setting: Setting) -> None:
    """Drop stage outputs and loaded payloads that no later stage reads under `setting`, so peak memory stays near
    the inputs (the reference log-probs go once advantage.kl ran, unless the loss takes a KL term)."""
    needed_outputs = {dep for stage in later for dep in stage.dependencies(setting)}
    for stage_id in [s for s in outputs if s not in needed_outputs]:
        del outputs[stage_id]
    cache.retain({name for stage in later for name in stage.io.payloads_read_under(setting)})


__all__ = ["PER_SAMPLE_OUTPUTS", "execute", "execute_keeping", "replay"]
