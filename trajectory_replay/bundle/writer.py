"""BundleWriter: build a bundle by hand or from capture, in the content-addressed store.

The store root is the bundle's parent, so sibling bundles share its objects. Payloads
are safetensors blobs (per-token ones cut at their sample rows, so runs of rows shared with
another bundle are stored once); loss masks move from the records into a per-token uint8
payload; manifest, index and expected are compact JSON blobs. The bundle directory holds
only markers. Before it writes or reuses any object, the writer lists it in its in-flight
record (`store.liveness.InflightRecord`), which gc treats as a root until the writer removes it
after commit or it passes its TTL.

Only structure is checked here (names, tensor-ness, sizes against dtype and shape); NaNs,
wrong-length lists and unsupported algorithms are written as given: a bundle that reproduces a broken step must be
writable.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trajectory_replay.backends import redact_url
from trajectory_replay.bundle import codec
from trajectory_replay.bundle.anchor import Anchor
from trajectory_replay.bundle.documents import (
    MAX_JSON_DEPTH,
    compact_json,
    nesting_exceeds,
    validate_document,
)
from trajectory_replay.bundle.markers import (
    CompleteMarker,
    DocRef,
    Documents,
    RankMarker,
    abandoned_key,
    abandoned_note,
    check_rank_list,
    complete_key,
    rank_key,
    read_abandoned,
    read_complete,
    read_marker,
    try_finalize,
)
from trajectory_replay.bundle.paths import split_bundle_path
from trajectory_replay.bundle.profiles import profile
from trajectory_replay.bundle.redaction import check_policy, redact_samples
from trajectory_replay.bundle.schema import (
    BundleIndex,
    ConventionsRecord,
    Expected,
    Manifest,
    PayloadSpec,
    SampleRecord,
    SchemaWarning,
    check_name,
)
from trajectory_replay.bundle.stage_io import LOSS_MASK, RECORDED_PAYLOADS
from trajectory_replay.errors import BundleError, StorageUnavailableError, TrajectoryReplayError
from trajectory_replay.outcome import one_line
from trajectory_replay.store import BlobRef, ObjectStore, PutPlan
from trajectory_replay.store.liveness import DEFAULT_INFLIGHT_TTL, GcWatch, InflightRecord

if TYPE_CHECKING:  # the reader imports this module; commands that only read must not pay for torch
    import torch

log = logging.getLogger(__name__)


def _documents(
    name: str,
    manifest: Manifest | Mapping[str, Any],
    index: BundleIndex | Mapping[str, Any],
) -> tuple[Manifest, BundleIndex]:
    """The manifest and index of bundle `name`, validated and agreeing on the bundle id; a manifest of a config built
    from a convention profile records which."""
    manifest = manifest if isinstance(manifest, Manifest) else validate_document(Manifest, manifest, "manifest")
    index = index if isinstance(index, BundleIndex) else validate_document(BundleIndex, index, "index")
    config = index.config
    if manifest.conventions is None and config.profile is not None:
        # a config built from a convention profile: the manifest says which, and at which framework version
        manifest = manifest.model_copy(update={"conventions": ConventionsRecord.of_profile(config.profile)})
    if manifest.producer.framework_version is None and config.profile is not None and config.framework_version:
        # the framework release that produced the step, which the profile's modelled version need not be
        producer = manifest.producer.model_copy(
            update={"framework": profile(config.profile).framework, "framework_version": config.framework_version}
        )
        manifest = manifest.model_copy(update={"producer": producer})
    # models built with model_copy skip validation: check the names they carry here
    check_or_raise(manifest.bundle_id, "bundle_id")
    check_policy(manifest.redaction, name)
    if manifest.bundle_id != index.bundle_id:
        raise BundleError(
            f"{name}: bundle_id differs between manifest ({manifest.bundle_id!r}) and index ({index.bundle_id!r})"
        )
    return manifest, index


def _expected_document(name: str, expected: Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The expected document of bundle `name` and its compact JSON, refused when readers would refuse it (schema
    warnings are logged: a bundle that reproduces a broken step must be writable)."""
    if not isinstance(expected, Mapping):
        raise BundleError(f"{name}: expected must be a mapping of stage -> outputs, got {type(expected).__name__}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SchemaWarning)
        validate_document(Expected, dict(expected), f"{name}: expected")
    for w in caught:
        log.warning("%s: %s", name, w.message)
    document = dict(expected)
    try:
        encoded = compact_json(document)
    except (TypeError, ValueError) as exc:
        raise BundleError(f"{name}: expected is not JSON-serializable ({exc})") from None
    if nesting_exceeds(encoded):  # readers refuse it: refuse it before anything is written
        raise BundleError(f"{name}: expected is nested more than {MAX_JSON_DEPTH} levels deep")
    return document, encoded


def _expected_ranks(name: str, rank: int | None, expected_ranks: Sequence[int] | None) -> list[int] | None:
    """The sorted ranks of a multi-producer bundle, which include `rank`; None for a bundle of one producer."""
    if rank is None:
        if expected_ranks is not None:
            raise BundleError(f"{name}: expected_ranks given without rank")
        return None
    ranks = sorted(set(check_rank_list(list(expected_ranks), name))) if expected_ranks is not None else None
    if not ranks:
        raise BundleError(f"{name}: rank={rank} needs expected_ranks")
    if rank not in ranks:
        raise BundleError(f"{name}: rank {rank} is not among expected ranks {ranks}")
    return ranks


class BundleWriter:
    """Write one bundle (or rank `rank` of a multi-producer bundle) at `<root>/<bundle_id>`.

    `run_id` (several producers): the launch of the job that writes this rank, the same for every rank of it; rank
    markers of different runs never complete one bundle together (a capture restarted into the same directory)."""

    def __init__(
        self,
        path_or_url: str | os.PathLike[str],
        manifest: Manifest | Mapping[str, Any],
        index: BundleIndex | Mapping[str, Any],
        expected: Mapping[str, Any],
        *,
        rank: int | None = None,
        expected_ranks: Sequence[int] | None = None,
        store: ObjectStore | None = None,
        unsafe_markers: bool = False,
        inflight_ttl: float = DEFAULT_INFLIGHT_TTL,
        run_id: str | None = None,
        **storage_options: Any,
    ) -> None:
        root, name, addressed_rank = split_bundle_path(os.fspath(path_or_url))
        if addressed_rank is not None:
            raise BundleError(f"{path_or_url}: write to the bundle path and pass rank={addressed_rank} instead")
        self.name = check_or_raise(name, "bundle id")
        self.manifest, self.index = _documents(name, manifest, index)
        self.expected, self._expected_bytes = _expected_document(name, expected)
        self.rank = rank
        self.expected_ranks = _expected_ranks(name, rank, expected_ranks)
        self.store = store or ObjectStore.open(root, **storage_options)
        self.unsafe_markers = unsafe_markers
        self.attempt = uuid.uuid4().hex
        self.run_id = run_id
        # taken before anything is found present: a sweep that may delete after that is seen at commit
        self._gc_watch = GcWatch(self.store.backend)
        self.inflight = InflightRecord(self.store.backend, self.attempt, self.name, inflight_ttl)
        self._needs: dict[str, list[str]] = {}
        """Blob digest -> every key the bundle needs to read it (ref, record, chunks)."""
        self._planned: dict[str, PutPlan] = {}
        self.payloads: dict[str, PayloadSpec] = {}
        self._finalized = False
        self._row_starts = self.index.token_offsets()
        self._batch_rows = micro_batch_rows(self.index, self._row_starts)

    @property
    def url(self) -> str:
        return f"{redact_url(self.store.url)}/{self.name}"

    # ---- payloads ------------------------------------------------------------------------------
    def write_payload(self, name: str, tensor: torch.Tensor) -> PayloadSpec:
        """Store one tensor payload now; its digests go into the manifest at finalize."""
        return self.write_payloads({name: tensor})[name]

    def write_payloads(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, PayloadSpec]:
        """Store several payloads now, together: all are encoded and hashed, listed in the in-flight record
        with one write, then uploaded concurrently (far fewer round trips than one at a time)."""
        self._check_open()
        specs = self._put_encoded(self._encode_payloads(tensors))
        self.payloads.update(specs)
        return specs

    def _encode_payloads(self, tensors: Mapping[str, torch.Tensor]) -> list[_Encoded]:
        encoded: list[_Encoded] = []
        for name, tensor in tensors.items():
            check_or_raise(name, "payload name")
            if name == LOSS_MASK:
                raise BundleError(
                    f"{self.url}: payload name 'loss_mask' is reserved: loss masks are written from "
                    "SampleRecord.loss_mask"
                )
            if name in self.payloads or any(e.name == name for e in encoded):
                raise BundleError(f"{self.url}: payload {name!r} was already written")
            encoded.append(self._encode(name, codec.check_storable(name, tensor), role=self._role(name)))
        return encoded

    def _role(self, name: str) -> str:
        expected = {o for c in self.manifest.stage_contracts.values() for o in c.expected_outputs}
        return "expected" if name in expected or name in RECORDED_PAYLOADS else "input"

    def _encode(self, name: str, tensor: torch.Tensor | codec.RawTensor, role: str) -> _Encoded:
        blob, data_start = codec.encode(tensor)
        per_token = tensor.dim() == 1
        cuts = boundaries = None
        if per_token and tensor.numel() == self._row_starts[-1]:
            itemsize = tensor.element_size()
            cuts = [data_start + s * itemsize for s in self._row_starts[:-1]]
            # A micro-batch's rows too few for a content-defined cut of their own (under the minimum chunk
            # size) are chunked on their own: a step-level payload and the rollout-level payload holding the
            # same micro-batches then share them even when small. Larger runs are left to content-defined
            # chunking, which finds the same cuts inside them in both blobs (forcing their edges would only
            # cut differently from a blob that does not know the micro-batches).
            small = range(ALIGNED_RUN_BYTES, self.store.chunking.min_size)
            boundaries = (
                sorted(
                    {
                        data_start + t * itemsize
                        for a, b in self._batch_rows
                        if (b - a) * itemsize in small
                        for t in (a, b)
                    }
                )
                or None
            )
        return _Encoded(
            name, role, blob, cuts, boundaries, codec.dtype_name(tensor.dtype), list(tensor.shape), per_token
        )

    def _put_encoded(self, encoded: Sequence[_Encoded]) -> dict[str, PayloadSpec]:
        refs = self._put_many([(e.blob, e.cuts, e.boundaries) for e in encoded])
        return {e.name: e.spec(ref) for e, ref in zip(encoded, refs)}

    def _put_many(self, items: Sequence[Any]) -> list[BlobRef]:
        def list_first(plans: list[PutPlan]) -> None:
            self.inflight.add([d for plan in plans for d in (plan.ref.digest, *plan.object_digests())])
            self._planned.update((plan.ref.digest, plan) for plan in plans)

        refs = self.store.put_many(items, before_write=list_first)
        for i, ref in enumerate(refs):
            plan = self._planned[ref.digest]
            # Another writer's ref may name its own record of the same blob (chunked differently). This writer
            # wrote its record and chunks itself after listing them, so it names those: the ones it knows whole.
            refs[i] = plan.ref
            self._needs[ref.digest] = plan.keys()
        self._planned.clear()
        return refs

    # ---- commit --------------------------------------------------------------------------------
    def finalize(
        self, ranks: Sequence[int] | None = None, *, payloads: Mapping[str, torch.Tensor] | None = None
    ) -> CompleteMarker | None:
        """Write the documents, then the markers (COMPLETE, or COMPLETE.<r> then try the final COMPLETE).

        `payloads` (name -> tensor) not written yet are written here, in one batch with the documents: one
        in-flight record write and one round of lookups and uploads for the whole bundle.
        Returns the final COMPLETE marker, or None when this producer of a multi-producer bundle did not write
        it: other ranks are missing, or another rank claimed finalizing (`markers.claim_finalizer`). Either
        way this writer's ranks have landed."""
        self._check_open()
        if ranks is not None:
            ranks = check_rank_list(list(ranks), self.url)
            if not ranks:
                raise BundleError(f"{self.url}: finalize(ranks=[]) lands no rank")
        sources: dict[str, tuple[Any, ...]] = {}
        documents = self._write_documents(self._encode_payloads(payloads or {}), sources)
        backend = self.store.backend
        self._check_survived_gc(sources)
        backend.require_atomic_create(unsafe=self.unsafe_markers)
        if self.rank is None:
            ranks = ranks if ranks is not None else [0]
            marker = CompleteMarker(
                bundle_id=self.manifest.bundle_id,
                anchor=Anchor.of(self.index.identity),
                expected_ranks=sorted(ranks),
                multi_rank=False,
                shards={str(ranks[0]): documents},
                attempt=self.attempt,
            )
            if not backend.create_if_absent(complete_key(self.name), compact_json(marker.model_dump(mode="json"))):
                existing = read_complete(backend, self.name)
                if existing is None or existing.all_digests() != marker.all_digests():
                    raise BundleError(
                        f"{self.url}: bundle already exists with different content; refusing to overwrite it"
                    )
                marker = existing
            result: CompleteMarker | None = marker
        else:
            ranks = list(ranks) if ranks is not None else [self.rank]
            for r in ranks:
                if r not in (self.expected_ranks or []):
                    raise BundleError(f"{self.url}: rank {r} is not among expected ranks {self.expected_ranks}")
                self._land_rank(r, documents)
            result = try_finalize(backend, self.name, self.expected_ranks, unsafe=self.unsafe_markers, claim=self.rank)
            # read after the cohort: gc writes its note before it removes a marker, so a rank found missing
            # because gc removed it is in the note by now
            removed = self._relanded(ranks, complete=result is not None)
        self.inflight.remove()
        self._finalized = True
        if result is None and removed:  # this rank landed (its marker is there): the record can go first
            self._check_cohort_kept(removed)
        return result

    def _check_survived_gc(self, sources: Mapping[str, tuple[Any, ...]]) -> None:
        """Commit only a bundle whose every object exists, whatever gc did meanwhile.

        What this writer found present was listed in its in-flight record first, so a sweep that starts
        later spares it; only a sweep already under way could remove it. If one may have run since the
        writer started (`GcWatch.settle` waits out any that still runs), every key the bundle needs is
        looked for on the backend. Blobs of this batch (`sources`: digest -> what `put` takes) are stored
        again; a missing blob written earlier, whose bytes the writer no longer holds, refuses the commit."""
        try:
            swept = self._gc_watch.settle(self.url)
        except StorageUnavailableError:
            raise
        except TrajectoryReplayError as exc:
            raise BundleError(str(exc)) from None
        if not swept:
            return
        for attempt in range(2):
            absent = set(self.store.missing_keys([k for keys in self._needs.values() for k in keys]))
            broken = [d for d, keys in self._needs.items() if absent.intersection(keys)]
            if not broken:
                return
            lost = [d for d in broken if d not in sources]
            if lost or attempt:
                first = next(k for k in self._needs[(lost or broken)[0]] if k in absent)
                raise BundleError(
                    f"{self.url}: {len(absent)} object(s) this bundle needs were removed by a "
                    f"concurrent gc (first {first}); nothing was committed, write the bundle again"
                )
            log.warning(
                "%s: a concurrent gc removed %d object(s) of %d blob(s) this bundle reuses; storing them again",
                self.url,
                len(absent),
                len(broken),
            )
            self._put_many([sources[d] for d in broken])

    def _relanded(self, ranks: Sequence[int], complete: bool) -> list[int]:
        """The ranks gc removed from this bundle as an abandoned cohort (its ABANDONED note) other than `ranks`,
        which this writer has just landed again: the note is rewritten without them, and removed once it lists
        none or the bundle is `complete`."""
        backend = self.store.backend
        removed = read_abandoned(backend, self.name)
        rest = [] if complete else [r for r in removed if r not in ranks]
        if len(rest) < len(removed):
            if rest:
                backend.write(abandoned_key(self.name), abandoned_note(rest, time.time()))
            else:
                backend.delete(abandoned_key(self.name))
        return rest

    def _check_cohort_kept(self, removed: Sequence[int]) -> None:
        """BundleError when a rank whose marker gc removed (`removed`, by the ABANDONED note) is still missing:
        the cohort this rank landed into lost a landing, so it cannot complete as captured, and returning normally
        would lose the capture without a word."""
        backend = self.store.backend
        gone = [r for r in removed if not backend.exists(rank_key(self.name, r))]
        if gone:
            raise BundleError(
                f"{self.url}: gc removed the landed rank marker(s) {one_line(str(gone), 80)} of this bundle as an "
                f"abandoned cohort (older than its --grace; see {abandoned_key(self.name)}); this rank landed, but "
                "the bundle completes only once those ranks land again: capture the step again, and give gc a "
                "--grace longer than a step's capture"
            )

    def _land_rank(self, rank: int, documents: Documents) -> None:
        """Create COMPLETE.<rank>; a marker already there is this rank landed by an earlier attempt, accepted
        only when it names the same bundle, anchor, expected ranks and documents (a retry of the same job).
        Different content is another run's landing (a capture restarted into the same directory): taking it
        as landed would mix the two runs in one bundle, so the write is refused."""
        backend = self.store.backend
        marker = RankMarker(
            bundle_id=self.manifest.bundle_id,
            rank=rank,
            anchor=Anchor.of(self.index.identity),
            expected_ranks=list(self.expected_ranks or []),
            documents=documents,
            attempt=self.attempt,
            created=time.time(),
            run=self.run_id,
        )
        document = marker.model_dump(mode="json", exclude={"run"} if self.run_id is None else set())
        if backend.create_if_absent(rank_key(self.name, rank), compact_json(document)):
            return
        key = f"{redact_url(backend.url)}/{rank_key(self.name, rank)}"
        try:
            earlier = read_marker(backend, rank_key(self.name, rank), RankMarker)
        except BundleError as exc:
            raise BundleError(
                f"{key}: rank {rank} already landed, and its marker cannot be read ({exc}); refusing to land it again"
            ) from None
        if earlier is None:
            raise BundleError(
                f"{key}: rank {rank}'s marker was removed while it landed (by gc?); nothing is "
                "landed, write the bundle again"
            )
        if _landing(earlier) != _landing(marker):
            runs = f", run {earlier.run}, this run {self.run_id}" if earlier.run != self.run_id else ""
            raise BundleError(
                f"{key}: rank {rank} already landed with different content (attempt "
                f"{earlier.attempt}{runs}); refusing to mix two captures in one bundle: "
                "write into a new directory, or remove the bundle first"
            )
        # the same landing from an earlier attempt of this rank's job: its retry stops here
        log.info("%s: rank %d already landed (attempt %s)", self.url, rank, earlier.attempt)

    def _write_documents(
        self, pending: Sequence[_Encoded] = (), sources: dict[str, tuple[Any, ...]] | None = None
    ) -> Documents:
        """Write the payloads still `pending`, the loss mask and the three documents, in one batch.

        `sources` receives digest -> (data, cuts, boundaries) of every blob of the batch."""
        index = self.index.model_copy(update={"samples": redact_samples(self.index.samples, self.manifest.redaction)})
        encoded = list(pending)
        if all(len(s.loss_mask) == s.response_length for s in index.samples):
            encoded.append(self._encode(LOSS_MASK, self._mask_tensor(index.samples), role="input"))
            index = index.model_copy(
                update={"samples": [s.model_copy(update={"loss_mask": []}) for s in index.samples]}
            )
        # else: a mask whose length differs from its response is kept in the record as given, for replay to report
        # the manifest names the payloads' digests before anything is written: hash them, write them with the rest
        plans = self.store.plan_many([(e.blob, e.cuts, e.boundaries) for e in encoded])
        payloads = {**self.payloads, **{e.name: e.spec(plan.ref) for e, plan in zip(encoded, plans)}}
        labels = ("manifest", "index", "expected")
        docs = [self._manifest_bytes(payloads), compact_json(index.model_dump(mode="json")), self._expected_bytes]
        refs = self._put_many([*plans, *((d, None) for d in docs)])
        if sources is not None:
            sources.update((p.ref.digest, p.source) for p in plans)
            sources.update((ref.digest, (doc, None, None)) for ref, doc in zip(refs[len(plans) :], docs))
        stored, refs = refs[: len(plans)], refs[len(plans) :]
        moved = {e.name: ref for e, plan, ref in zip(encoded, plans, stored) if ref.record != plan.ref.record}
        if moved:
            # a concurrent writer stored the same payload first, chunked differently: name its record
            payloads.update(
                {name: payloads[name].model_copy(update={"record": ref.record}) for name, ref in moved.items()}
            )
            manifest = self._manifest_bytes(payloads)
            refs[0] = self._put_many([(manifest, None)])[0]
            if sources is not None:
                sources[refs[0].digest] = (manifest, None, None)
        self.payloads.update({e.name: payloads[e.name] for e in pending})
        return Documents(**{label: DocRef.of(ref) for label, ref in zip(labels, refs)})

    def _manifest_bytes(self, payloads: Mapping[str, PayloadSpec]) -> bytes:
        doc = self.manifest.model_copy(update={"payloads": dict(payloads)}).model_dump(mode="json")
        # optional parts a bundle rarely has are left out rather than written as null, so readers that predate
        # them see the same document as before
        for optional in ("conventions", "trigger"):
            if doc.get(optional) is None:
                doc.pop(optional, None)
        for contract in doc["stage_contracts"].values():
            if contract.get("kernel") is None:
                contract.pop("kernel", None)
        return compact_json(doc)

    def _mask_tensor(self, samples: Sequence[SampleRecord]) -> codec.RawTensor:
        """The records' loss masks as one uint8 tensor (made without torch: the capture writer process never
        imports it); BundleError naming the first sample with a value not 0/1."""
        try:  # bytes() of a list of small ints runs in C: a mask of millions of tokens costs milliseconds
            data = b"".join(bytes(s.loss_mask) for s in samples)
        except (TypeError, ValueError):  # not all ints in 0..255 (1.0, True, -1, 256, ...): the exact slow path
            data = None
        if data is None or data.translate(None, b"\x00\x01"):  # some byte other than 0 and 1
            bad = next((s for s in samples if any(v not in (0, 1) for v in s.loss_mask)), None)
            if bad is not None:
                raise BundleError(f"{self.url}: sample {bad.sample_id}: loss_mask values must be 0 or 1")
            data = bytes(int(v) for s in samples for v in s.loss_mask)
        return codec.RawTensor("torch.uint8", (len(data),), data)

    def abort(self) -> None:
        """Give up: remove the in-flight record (what was written becomes garbage for gc)."""
        self.inflight.remove()
        self._finalized = True

    def _check_open(self) -> None:
        if self._finalized:
            raise BundleError(f"{self.url}: writer already finalized")


def _landing(marker: RankMarker) -> tuple[Any, ...]:
    """What makes two rank markers the same landing (the attempt and the time aside)."""
    return (
        marker.bundle_id,
        marker.rank,
        marker.anchor,
        sorted(marker.expected_ranks),
        marker.documents.digests(),
        marker.run,
    )


@dataclass(frozen=True)
class _Encoded:
    """A payload encoded for storage, not yet written."""

    name: str
    role: str
    blob: bytes
    cuts: list[int] | None
    boundaries: list[int] | None
    dtype: str
    shape: list[int]
    per_token: bool

    def spec(self, ref: BlobRef) -> PayloadSpec:
        """The manifest entry of this payload, stored as `ref`."""
        return PayloadSpec(
            name=self.name,
            role=self.role,
            codec="safetensors",
            dtype=self.dtype,
            shape=self.shape,
            size=ref.size,
            digest=ref.digest,
            record=ref.record,
            per_token=self.per_token,
        )


ALIGNED_RUN_BYTES = 1 << 10
"""A micro-batch's rows of a per-token payload are chunked on their own from this many bytes (up to the
minimum chunk size); smaller runs would only add objects (and requests) to save a few hundred bytes."""


def micro_batch_rows(index: BundleIndex, row_starts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) token offsets of each run of consecutive samples sharing a micro_batch_id."""
    samples, runs, first = index.samples, [], 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i].micro_batch_id != samples[first].micro_batch_id:
            if samples[first].micro_batch_id:
                runs.append((row_starts[first], row_starts[i]))
            first = i
    return runs


def check_or_raise(value: str, what: str) -> str:
    """`check_name` as a BundleError."""
    try:
        return check_name(value, what)
    except ValueError as exc:
        raise BundleError(str(exc)) from None


__all__ = ["BundleWriter", "LOSS_MASK"]
