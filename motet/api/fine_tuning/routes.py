"""OpenAI's fine-tuning API (the store: motet/api/fine_tuning/store.py; the runner: motet/api/fine_tuning/runner.py).

POST /v1/fine_tuning/jobs                          training_file (a `fine-tune` file of the tenant's),
                                                   validation_file, model (the served model, or one of the
                                                   tenant's adapters to train on), suffix, seed, method, the legacy
                                                   hyperparameters, metadata
GET  /v1/fine_tuning/jobs                          the tenant's jobs, newest first: after, limit, metadata[k]=v
                                                   or metadata=null (OpenAI's filter)
GET  /v1/fine_tuning/jobs/{job_id}
POST /v1/fine_tuning/jobs/{job_id}/cancel          stops it at once
POST /v1/fine_tuning/jobs/{job_id}/pause           a checkpoint after the step in progress, then it waits
POST /v1/fine_tuning/jobs/{job_id}/resume          queued again, it goes on from there
GET  /v1/fine_tuning/jobs/{job_id}/events          newest first: after, limit
GET  /v1/fine_tuning/jobs/{job_id}/checkpoints     one an epoch, newest first: after, limit

A job is checked whole before it is queued: its body, the model, its files (each line, tokenized as serving
renders it: motet/training/), its hyperparameters and the tenant's quotas; whatever is wrong is a 400 (429 for a
quota) in OpenAI's shape naming what to fix, and nothing is kept. Files over INLINE_BYTES are tokenized after the
call answers, the job `validating_files` meanwhile (motet/api/fine_tuning/validation.py): a bad line then fails the
job with the 400's error. What costs little is checked first: the files'
examples are counted, the hyperparameters resolved for them and the room its adapters will take found before an
example is tokenized. A tenant's validations run --fine-tuning-max-validating at a time (the others wait their turn;
another tenant's never wait on them), each counted with its CPU time in the metrics. A job queued holds the room
of its adapters in the tenant's adapter quota until it ends (motet/api/fine_tuning/store.py). Every call is scoped
to the caller's tenant:
another tenant's job reads as missing (404), another tenant's file as no file (400, as the Batch API's input file).
"""

from __future__ import annotations

import functools
import re
import shutil
from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from motet.api.completions.generation import served_formats
from motet.api.errors import APIError, echo
from motet.api.files.store import FileStore, StoredFile
from motet.api.fine_tuning.models import FineTuningJobCreate
from motet.api.fine_tuning.runner import FineTuningRunner
from motet.api.fine_tuning.store import FineTuningStore, QuotaExceeded, new_job_id, stored_adapters
from motet.api.fine_tuning.validation import (
    FILES,
    Refusal,
    cpu_timed,
    inline,
    prepare_job,
    validated_event,
)
from motet.api.list_pages import stored_page
from motet.api.openapi import operation
from motet.api.request_body import read_json
from motet.api.sqlite_store import StorageFailure, storage_failures
from motet.api.state import ServerState, state_and_tenant
from motet.api.storage_errors import storage_error, stored_call
from motet.lora.registry import FILES as ADAPTER_FILES
from motet.serial_imports import imported
from motet.training.dataset import MAX_EXAMPLES
from motet.training.eval_file import MAX_EXAMPLES as EVAL_MAX_EXAMPLES
from motet.training.hyperparameters import HyperparameterError, Hyperparameters
from motet.training.run_setup import FileError, RunFiles, count_file, plan_run, write_run
from motet.training.trainer import TrainingRun, stored_adapter_bytes

T = TypeVar("T")
PURPOSE = "fine-tune"
_METADATA_KEY = re.compile(r"^metadata\[(.*)\]$", re.DOTALL)
INIT_ADAPTER = "init_adapter"  # in a job's run directory: a copy of the adapter it trains on


def run_files(state: ServerState) -> RunFiles:
    """What training needs to know of the served model (the runner is given this function when it starts: its
    module imports neither the server's state nor the chat routes)."""
    view = state.system.model
    tools = served_formats(state, view.chat_template)[0]
    return RunFiles(
        view.model_dir, view.model_config, view.tokenizer, tools, view.max_model_len, view.max_lora_rank
    )


def _context(request: Request) -> tuple[ServerState, str, FineTuningRunner]:
    state, tenant = state_and_tenant(request)
    if state.fine_tuning is None:
        raise APIError(404, "this server runs no fine-tuning jobs")
    return state, tenant, state.fine_tuning


def _no_such_job(job_id: str) -> APIError:
    return APIError(404, f"No such fine-tuning job: {echo(job_id)}", param="fine_tuning_job_id",
                    code="fine_tuning_job_not_found")  # fmt: skip


async def _path_job(request: Request) -> tuple[FineTuningRunner, str, dict]:
    _, tenant, runner = _context(request)
    job_id = request.path_params["job_id"]
    job = await stored_call("the job could not be read", runner.store.get, tenant, job_id)
    if job is None:
        raise _no_such_job(job_id)
    return runner, tenant, job


def fine_tuned_name(base: str, tenant: str, suffix: str | None, job_id: str) -> str:
    """OpenAI's `ft:<base>:<tenant>:<suffix>:<job id>` (the base's name made safe for a directory's)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", base)[:64]
    return f"ft:{base}:{tenant}:{suffix or ''}:{job_id}"


async def _file(files: FileStore, tenant: str, file_id: str | None, param: str) -> StoredFile | None:
    if file_id is None:
        return None
    stored = await stored_call("the file could not be read", files.get, tenant, file_id)
    if stored is None:
        raise APIError(400, f"invalid {param}: no file {echo(file_id)}", param=param, code="file_not_found")
    if stored.purpose != PURPOSE:
        raise APIError(400, f"invalid {param}: the file's purpose is {stored.purpose!r}; a fine-tuning job reads "
                       f"{PURPOSE!r} files (upload it with purpose={PURPOSE})", param=param)  # fmt: skip
    return stored


async def _base(state: ServerState, tenant: str, model: str):
    """The adapter `model` names to train on (None: the base model); a model not served: 400."""
    try:
        return await state.resolve_adapter(tenant, model)
    except APIError:
        raise APIError(400, f"the model {echo(model)} is not available for fine-tuning on this server: give the "
                       f"served model ({state.model_name!r}) or one of your adapters", param="model",
                       code="model_not_available") from None  # fmt: skip


def _no_room(each: int, h: Hyperparameters, where: str) -> Callable[[int], APIError]:
    """The refusal of a job whose adapters would not fit in the `room` the tenant's adapters have left."""

    def refusal(room: int) -> APIError:
        n = stored_adapters(h)
        return APIError(
            400,
            f"the job would store {n} adapters (a checkpoint each epoch, then its model) of {each} bytes, "
            f"{n * each} in all, and this tenant's adapters have room for {room} more "
            "(--adapters-max-bytes-per-tenant; its other jobs' adapters count from when they are queued): delete "
            "some adapters (DELETE /v1/adapters/{name}), or train fewer epochs or a smaller lora_rank",
            param=f"{where}.n_epochs",
            code="storage_quota_exceeded",
        )

    return refusal


@operation("create a fine-tuning job", tag="Fine-tuning", body=FineTuningJobCreate,
           ok_description="the FineTuningJob", example=lambda model: {  # (a file POST /v1/files answered, fine-tune)
               "training_file": "file-abc123", "model": model, "suffix": "my-model",
               "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3}}}})  # fmt: skip
async def create_job(request: Request) -> Response:
    state, tenant, runner = _context(request)
    state.check_ready()
    req = FineTuningJobCreate.model_validate(await read_json(request, state.max_body_bytes))
    try:
        method, given, where = req.method_and_hyperparameters()
    except ValueError as e:
        raise APIError(400, str(e), param="method") from None
    adapter = await _base(state, tenant, req.model)
    stored = {which: await _file(runner.files, tenant, getattr(req, which), which) for which in FILES}
    store, quotas = runner.store, runner.quotas
    try:
        await stored_call("the jobs could not be read", store.check_quotas, tenant, 0, quotas)
    except QuotaExceeded as e:
        raise APIError(429, str(e), code=e.code) from None
    view = state.system.model
    model = run_files(state)
    job_id = new_job_id()
    run_dir = store.run_dir(job_id)
    name = fine_tuned_name(state.model_name, tenant, req.suffix, job_id)
    seed = req.seed if req.seed is not None else int.from_bytes(job_id.encode()[-4:], "big") & 0x7FFFFFFF
    most = {"training_file": MAX_EXAMPLES, "validation_file": MAX_EXAMPLES, "eval_file": EVAL_MAX_EXAMPLES}
    now = inline(list(stored.values())) or not runner.validates_later  # else: after the create call answers
    ids = {which: getattr(req, which) for which in FILES}

    def plan() -> tuple[TrainingRun, int, int]:
        """What can be refused before an example is read: each file's examples counted, the hyperparameters resolved
        for them, and the bytes of each adapter the job will store; the run's spec written (its validation, done
        again after a restart, reads it)."""
        counts = {}
        for which, f in stored.items():
            if f is not None:
                with runner.files.open(f) as source:
                    counts[which] = count_file(source, which, most[which])
        init = None
        if adapter is not None:
            init = run_dir / INIT_ADAPTER
            init.mkdir(parents=True)
            for f in ADAPTER_FILES:
                shutil.copyfile(adapter.path / f, init / f)
        dtype = view.dtype if view.dtype in ("float32", "bfloat16") else "float32"
        run = plan_run(model, method, counts["training_file"], given, seed=seed, run_dir=run_dir, dtype=dtype,
                       base_name=state.model_name, init_adapter=init)  # fmt: skip
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run(run)
        return run, stored_adapter_bytes(run, view.model_config), counts["training_file"]

    def step(call: Callable[[], T]) -> Callable[[], T]:
        """`call` as a step of the validation: its CPU time counted, nothing kept if it refuses the job."""

        def run_step() -> T:
            try:
                # (the steps use peft, and through it transformers: imported first, one thread at a time, not held
                # while a step runs: another tenant's validation goes on beside it; motet/serial_imports.py)
                imported("peft")
                with storage_failures():
                    return cpu_timed(call, cpu)()
            except BaseException:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise

        return run_step

    cpu, outcome = [0.0], "refused"
    try:
        async with runner.validation(
            tenant
        ):  # the tenant's validations at most --fine-tuning-max-validating at once
            try:
                run, each, examples = await stored_call("the training file could not be read", step(plan))
                need = each * stored_adapters(run.hyperparameters)
                room = await runner.adapters.room(
                    tenant
                )  # its adapters fit, or it is refused before tokenizing
                if room is not None and need > room:
                    raise _no_room(each, run.hyperparameters, where)(max(room, 0))
                prepared = None
                if now:
                    prepare = functools.partial(prepare_job, runner.files, model, run, tenant, ids)
                    prepared = await stored_call("the training file could not be read", step(prepare))
            except FileError as e:
                refusal = Refusal.of(e, getattr(req, e.which))
                raise APIError(400, refusal.message, param=refusal.param, code=refusal.code) from None
            except HyperparameterError as e:
                raise APIError(
                    400, str(e), param=f"{where}.{e.name}", code="invalid_hyperparameters"
                ) from None
            except BaseException:
                await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, run_dir, True))
                raise
        events = [f"Validating training file: {req.training_file}"]
        if req.validation_file:
            events.append(f"Validating validation file: {req.validation_file}")
        if req.eval_file:
            events.append(
                f"Validating eval file: {req.eval_file} (its answers are compared once the job has trained)"
            )
        if prepared is not None:
            events.append(validated_event(prepared))
        create = functools.partial(
            store.create, job_id, tenant, model=req.model, model_name=name, training_file=req.training_file,
            validation_file=req.validation_file, eval_file=req.eval_file, suffix=req.suffix, seed=seed,
            method=method, hyperparameters=run.hyperparameters, metadata=req.metadata,
            examples=prepared.examples if prepared else examples, tokens_per_epoch=prepared.tokens if prepared else 0,
            events=events, quotas=quotas, adapter_bytes=each, validated=prepared is not None,
        )  # fmt: skip
        try:  # the room of its adapters taken with the job, one at a time with the tenant's other saves and jobs
            job = await runner.adapters.reserve(
                tenant, need, create, _no_room(each, run.hyperparameters, where)
            )
        except BaseException as e:
            await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, run_dir, True))
            if isinstance(e, QuotaExceeded):
                raise APIError(429, str(e), code=e.code) from None
            if isinstance(e, StorageFailure):
                raise storage_error(e, "the job could not be stored") from None
            raise
        outcome = "queued" if prepared is not None else "later"
    finally:
        if outcome != "later":  # (a validation after the call answers is counted when it ends)
            state.metrics.observe_fine_tuning_validation(tenant, outcome, cpu[0])
    if prepared is None:
        runner.validate_later(job_id, tenant, cpu[0])
    runner.wake()
    return JSONResponse(job)


def metadata_filter(query: QueryParams) -> tuple[QueryParams, dict[str, str], bool]:
    """OpenAI's metadata filter of the jobs listed: `metadata[k]=v` (each pair the job's metadata must hold; an
    empty value: the key with an empty string), or `metadata=null` (the jobs that have none). The query without it,
    the pairs, and whether it is `metadata=null`."""
    rest, pairs, null = [], {}, False
    for key, value in query.multi_items():
        if key == "metadata":
            if value != "null":
                raise APIError(400, f"metadata: filter with metadata[key]=value, or metadata=null for the jobs "
                               f"without metadata, not metadata={echo(value)}", param="metadata")  # fmt: skip
            null = True
        elif (m := _METADATA_KEY.match(key)) is not None:
            if m[1] in pairs:
                raise APIError(400, f"{echo(key)} is given twice", param=key)
            pairs[m[1]] = value
        else:
            rest.append((key, value))
    if null and pairs:
        raise APIError(
            400, "metadata=null and metadata[key]=value filters cannot be combined", param="metadata"
        )
    return QueryParams(rest), pairs, null


@operation("the tenant's fine-tuning jobs, newest first", tag="Fine-tuning", ok_description="a list of jobs",
           query={"after": str, "limit": int, "metadata": dict[str, str]})  # fmt: skip
async def list_jobs(request: Request) -> Response:
    _, tenant, runner = _context(request)
    query, pairs, null = metadata_filter(request.query_params)
    page = await stored_page(query, "the jobs could not be read", "fine-tuning job", "tenant", runner.store.page,
                             tenant, metadata=pairs, without_metadata=null)  # fmt: skip
    return JSONResponse(page)


@operation("a fine-tuning job", tag="Fine-tuning", ok_description="the FineTuningJob")
async def retrieve_job(request: Request) -> Response:
    _, _, job = await _path_job(request)
    return JSONResponse(job)


async def _change(request: Request, to: str, allowed: tuple[str, ...], message: str, verb: str) -> dict:
    runner, tenant, job = await _path_job(request)
    changed = await stored_call("the job could not be changed", runner.store.change, tenant, job["id"], to,
                                allowed, message)  # fmt: skip
    job, moved = changed
    if not moved:
        raise APIError(409, f"the job is {job['status']}: only a {' or '.join(allowed)} job can be {verb}",
                       param="fine_tuning_job_id", code="invalid_job_status")  # fmt: skip
    return job


@operation(
    "cancel a fine-tuning job: its training stops at once", tag="Fine-tuning", ok_description="the job"
)
async def cancel_job(request: Request) -> Response:
    job = await _change(
        request,
        "cancelled",
        ("validating_files", "queued", "running", "paused"),
        "The job was cancelled",
        "cancelled",
    )
    runner = request.app.state.motet.fine_tuning
    runner.stop(job["id"], pause=False)
    await runner.finished(job["id"])
    return JSONResponse(job)


@operation("pause a fine-tuning job (a checkpoint after the step in progress)", tag="Fine-tuning",
           ok_description="the job")  # fmt: skip
async def pause_job(request: Request) -> Response:
    message = "Pausing the job: a checkpoint is saved after the step in progress"
    job = await _change(request, "paused", ("queued", "running"), message, "paused")
    request.app.state.motet.fine_tuning.stop(job["id"], pause=True)
    return JSONResponse(job)


@operation("resume a paused fine-tuning job", tag="Fine-tuning", ok_description="the job")
async def resume_job(request: Request) -> Response:
    job = await _change(request, "queued", ("paused",), "The job was resumed: queued again", "resumed")
    request.app.state.motet.fine_tuning.wake()
    return JSONResponse(job)


async def _page(request: Request, what: str, read, default_limit: int) -> Response:
    runner, tenant, job = await _path_job(request)
    page = await stored_page(request.query_params, f"the {what} could not be read", what[:-1], "job", read,
                             runner.store, tenant, job["id"], default_limit=default_limit)  # fmt: skip
    return JSONResponse(page)


@operation("a fine-tuning job's events, newest first", tag="Fine-tuning", ok_description="a list of events",
           query={"after": str, "limit": int})  # fmt: skip
async def list_events(request: Request) -> Response:
    return await _page(request, "events", FineTuningStore.events, 20)


@operation("a fine-tuning job's checkpoints (one an epoch), newest first", tag="Fine-tuning",
           ok_description="a list of checkpoints", query={"after": str, "limit": int})  # fmt: skip
async def list_checkpoints(request: Request) -> Response:
    return await _page(request, "checkpoints", FineTuningStore.checkpoints, 10)
