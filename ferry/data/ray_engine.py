"""Tokenising the parts of a text corpus as Ray tasks: `ferry data prepare --engine ray [--address ADDR]`.

Each part (`ferry.data.formats.Part`: a file, a Parquet row group, a byte range of a large file) is one Ray
task of one CPU. The task reads its part where it runs, so every node must see the inputs at the same path (a
shared filesystem or mount); it tokenises with the dataset's tokenizer, put once into the object store, and
returns the part's token stream through the object store. The prepare process (Ray's driver) writes each
stream as a part file and appends the part files to the shards in input order, as `--workers` does: the
dataset is byte for byte the one a single process writes, and only the driver writes, so the output needs
no shared storage. At most two tasks per CPU are in flight, and the driver holds the streams of those only.

Without `--address`, a local Ray is started here with the machine's CPUs (or `--workers N`), no dashboard,
and stopped at the end; with one, the job joins that cluster and uses at most `--workers` of its CPUs. What Ray
logs in the driver (its token authentication warning on every start) goes to the dataset's `libraries.log`, not
the console; the workers' logs stay in Ray's session directory.

Failures: a task whose worker process or node died is run again by Ray (`max_retries`), as is one whose read
raised an OSError (a network filesystem's hiccup); after `retries` further attempts the failure is final and
reported naming the input file. A malformed line or row is final at once, reported as without Ray (file and
line): reading the same bytes again cannot mend it.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ferry.config.errors import UserError
from ferry.config.extras import import_extra
from ferry.data.formats import Part
from ferry.data.tokenizer import Tokenizer, tokenizer_from_json
from ferry.data.workers import PartTokens, encode_part, part_file
from ferry.platform.library_logs import LIBRARY_LOG_FILE, library_logs_in

_LOOK_AHEAD = 2  # tasks in flight per CPU: one running, one waiting to be taken
_CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class RayEngine:
    """Where the parts are tokenised: `address` of a running cluster (None: a local Ray started for this
    preparation), at most `cpus` tasks at a time (None: every CPU the cluster has), each retried `retries`
    times after its worker died or its read failed."""

    address: str | None = None
    cpus: int | None = None
    retries: int = 3

    def check(self) -> None:
        if self.cpus is not None and self.cpus < 1:
            raise UserError(f"--workers must be at least 1, got {self.cpus}")
        if self.retries < 0:
            raise UserError(f"--retries must be 0 or more, got {self.retries}")


def tokenize_parts_on_ray(
    parts: list[tuple[int, Part]],
    tokenizer: Tokenizer,
    text_field: str,
    dtype: np.dtype,
    directory: Path,
    engine: RayEngine,
    where: dict,
) -> Iterator[PartTokens]:
    """The (index, part) pairs tokenised by Ray tasks into part files in `directory`, yielded in the order given.
    `where` receives the description of the cluster that ran them (the manifest's `prepared_by`); Ray's driver log
    goes beside `directory`, in the dataset (`libraries.log`)."""
    ray = import_extra("ray", "ray", "--engine ray", "Ray")
    with library_logs_in(directory.parent / LIBRARY_LOG_FILE, ("ray",), unhandled=True):
        yield from _on_ray(ray, parts, tokenizer, text_field, dtype, directory, engine, where)


def _on_ray(
    ray, parts, tokenizer: Tokenizer, text_field: str, dtype: np.dtype, directory: Path, engine: RayEngine, where: dict
) -> Iterator[PartTokens]:
    started_here = not ray.is_initialized()
    if started_here:
        _start(ray, engine)
    try:
        cluster_cpus = int(ray.cluster_resources().get("CPU", 0))
        if cluster_cpus < 1:
            raise UserError(f"the Ray cluster at {engine.address or 'this machine'} has no CPUs to run tasks on")
        cpus = min(engine.cpus or cluster_cpus, cluster_cpus)
        where.update(
            engine="ray",
            ray=ray.__version__,
            address=engine.address or "local",
            nodes=sum(1 for node in ray.nodes() if node.get("Alive")),
            cpus=cpus,
        )
        yield from _run_tasks(ray, parts, tokenizer, text_field, dtype, directory, engine, cpus)
    finally:
        if started_here:
            ray.shutdown()


def _start(ray, engine: RayEngine) -> None:
    """A local Ray, or the cluster at `engine.address` joined (checked to answer first: Ray itself retries an
    address where nothing listens for minutes)."""
    if engine.address is not None:
        _check_listening(engine.address)
    try:
        if engine.address is None:
            ray.init(
                num_cpus=engine.cpus or os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            ray.init(address=engine.address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if engine.address is None:
            raise UserError(f"--engine ray: cannot start a local Ray: {exc}") from None
        raise UserError(
            f"--engine ray: cannot join the Ray cluster at {engine.address}: {exc} (a cluster with token "
            "authentication, Ray's default, is joined by address with RAY_AUTH_MODE=token and its token in "
            "RAY_AUTH_TOKEN or ~/.ray/auth_token, as Ray's documentation says)"
        ) from None


def _check_listening(address: str) -> None:
    """A `host:port` address refused at once when nothing answers there (`auto` is Ray's to find)."""
    if address == "auto":
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r}: expected the head's host:port (e.g. head:6379) or auto")
    try:
        socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise UserError(f"--address {address}: no Ray cluster answers there ({exc})") from None


def _run_tasks(
    ray, parts, tokenizer: Tokenizer, text_field: str, dtype: np.dtype, directory: Path, engine: RayEngine, cpus: int
) -> Iterator[PartTokens]:
    tokenizer_ref = ray.put(tokenizer.to_json())
    task = ray.remote(_tokenize_part_task).options(num_cpus=1, max_retries=engine.retries, retry_exceptions=[OSError])
    waiting = iter(parts)
    pending: deque[tuple[int, Part, object]] = deque()

    def submit(count: int) -> None:
        for _ in range(count):
            if (item := next(waiting, None)) is None:
                return
            index, part = item
            pending.append((index, part, task.remote(part, tokenizer_ref, text_field, np.dtype(dtype).name)))

    try:
        submit(_LOOK_AHEAD * cpus)
        while pending:
            index, part, reference = pending.popleft()
            stream, tokens, documents, text_bytes, sha256 = _result(ray, reference, part, engine.retries)
            path = part_file(directory, index)
            path.write_bytes(stream)
            del stream
            submit(1)
            yield PartTokens(index, str(part.path), part.row_group, path, tokens, documents, text_bytes, sha256)
    except BaseException:  # an error, or the caller stopped reading: the tasks still running are not wanted
        for _, _, reference in pending:
            ray.cancel(reference, force=True)
        raise


def _result(ray, reference, part: Part, retries: int) -> tuple:
    """A task's result, or its final failure as a `UserError` naming the input file."""
    try:
        return ray.get(reference)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, UserError):
            raise UserError(str(cause)) from None
        raise UserError(
            f"reading {part.path} failed on Ray after {retries} retries: {type(cause).__name__}: {cause}"
        ) from None
    except ray.exceptions.RayError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"the Ray task tokenising {part.path} failed after {retries} retries ({type(exc).__name__}: {first_line})"
        ) from None


_tokenizers: dict[str, Tokenizer] = {}  # per worker process: the tokenizer built once from its JSON


def _tokenize_part_task(part: Part, tokenizer_json: str, text_field: str, dtype: str) -> tuple:
    """One part's token stream (bytes) with its tokens, documents, text bytes and sha256; run by a Ray worker,
    which encodes on one thread (a task holds one CPU)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if (tokenizer := _tokenizers.get(tokenizer_json)) is None:
        _tokenizers.clear()
        tokenizer = _tokenizers[tokenizer_json] = tokenizer_from_json(tokenizer_json, "the dataset's tokenizer")
    pieces: list[bytes] = []
    counts = encode_part(part, tokenizer, text_field, np.dtype(dtype), pieces.append)
    return (b"".join(pieces), *counts)
