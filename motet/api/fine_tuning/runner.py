"""The fine-tuning runner: queued jobs trained one at a time (by default), each in a child process beside serving.

The runner is a task of the app's lifespan (as the batch runner is). Whenever a slot is free it asks the fair queue
(motet/training/fair_queue.py: tenants in turn) which queued job goes next and starts its worker
(motet/api/fine_tuning/workers.py): a process forked from a fork server that has the training libraries imported,
with its own thread count (`--fine-tuning-threads`), dying with the server, or behind a Ray cluster a Ray Train run
on the node the operator names (motet/cluster/training_jobs.py). A local worker runs only while the serving engine
lends it the cores (motet/actors/training_lease.py: `--fine-tuning-share` of the time while serving is busy, all of
it while idle, one worker at a time): the job's events say when it waits for compute and when it no longer does, and
its `estimated_finish` is its pace while it computes over the share it gets. What the worker says (an event) becomes
the job's progress, events and checkpoints in the store (motet/api/fine_tuning/store.py); each epoch's checkpoint,
then the job's model, is stored as the tenant's adapter (motet/api/adapters/store.py), served from then on; the
trained tokens are counted in the tenant's usage as they are trained.

A job with an eval file has it answered once its model is stored, outside the training slots: the next queued job
starts training meanwhile. Cancel kills the worker at once, or stops the eval (its requests in flight aborted);
pause asks the worker to save a checkpoint after the step in progress and exit (a worker that has not yet said it
handles the request is killed: it had trained nothing). A job running when the server stops is queued again at the
next start (`FineTuningStore.recover`) and goes on from its last checkpoint. A finished job's run directory (its
rows and Trainer's checkpoints) is removed: its models live on as adapters.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import io
import json
import logging
import shutil
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from motet.api.adapters.store import AdapterStore
from motet.api.errors import APIError
from motet.api.files.store import FileStore
from motet.api.fine_tuning.settings import RunnerSettings
from motet.api.fine_tuning.store import FINISHED, FineTuningStore, QuotaExceeded, Quotas
from motet.api.fine_tuning.validation import Refusal, cpu_timed, prepare_job, validated_event
from motet.api.fine_tuning.workers import LocalWorker
from motet.api.in_process import call_route
from motet.api.sqlite_store import StorageFailure
from motet.api.usage import UsageStore
from motet.training.compute_share import waiting_reason
from motet.training.dataset import read_rows
from motet.training.eval_file import EVAL_ROWS, same_answer
from motet.training.fair_queue import next_job
from motet.training.launch import LaunchError, TrainingWorker
from motet.training.run_setup import FileError
from motet.training.trainer import CHECKPOINTS, TrainingRun, checkpoint_step, last_checkpoint
from motet.training.worker import RUN_SPEC

log = logging.getLogger("motet.fine_tuning")

POLL_S = 1.0  # how often the runner looks at the queue without being woken, and at a worker's compute
# An eval file's requests: the likeliest token each step, as trained, whatever sampling defaults the model's
# generation_config.json gives a request that leaves a field out (the default model's: frequency_penalty 0.7)
GREEDY = {"temperature": 0, "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1}
# A worker waits for compute if it mostly did over this long (motet/training/compute_share.py).
WAIT_WINDOW_S = 5.0
# A worker's niceness unless --fine-tuning-nice says: as serving's where the engine lends it the cores (it rations
# the worker's time), the lowest priority where nothing does (behind Ray, or beside a GPU's engine: the engine's host
# thread goes first).
LEASED_NICE, UNLEASED_NICE = 0, 19
RESULT_COLUMNS = (
    "step",
    "train_loss",
    "train_mean_token_accuracy",
    "valid_loss",
    "valid_mean_token_accuracy",
)


def checkpoint_model(model_name: str, step: int) -> str:
    """OpenAI's name of a job's checkpoint model."""
    return f"{model_name}:ckpt-step-{step}"


def result_file_id(job_id: str) -> str:
    """The job's result file: the same id each time it is written."""
    return "file-" + hashlib.sha256(f"{job_id}:results".encode()).hexdigest()[:24]


def results_csv(metrics: list[dict]) -> bytes:
    """OpenAI's result file: a row a step (a step's validation loss beside its training loss)."""
    rows: dict[int, dict] = {}
    for m in metrics:
        rows.setdefault(m["step"], {}).update({k: v for k, v in m.items() if k in RESULT_COLUMNS})
    out = io.StringIO()
    writer = csv.DictWriter(out, RESULT_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for step in sorted(rows):
        writer.writerow({k: "" if rows[step].get(k) is None else rows[step][k] for k in RESULT_COLUMNS})
    return out.getvalue().encode()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def chat_answer(app, tenant: str, model: str, row: dict) -> dict | None:
    """The chat completion's message for an eval row (None: the request was not answered)."""
    body = {"model": model, "messages": row["messages"], "max_tokens": row["max_tokens"], **GREEDY}
    if row["tools"]:
        body["tools"] = row["tools"]
    status, _, content = await call_route(app, "/v1/chat/completions", json.dumps(body).encode(), tenant)
    if status != 200:
        return None
    try:
        return json.loads(content)["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def _thread(call, *args):
    return await anyio.to_thread.run_sync(functools.partial(call, *args))


@contextlib.asynccontextmanager
async def _unleased() -> AsyncIterator[Callable[[int], bool]]:
    yield lambda pid: False


def _compute_message(reason: str | None, fraction: float, workers: int) -> str:
    """The event of a worker that started to wait for compute (`reason`: compute_share.waiting_reason's), or that
    no longer does (None)."""
    if reason == "jobs" and workers > 1:
        return f"Waiting for compute: {workers} fine-tuning jobs take turns; this one gets {fraction:.0%} of the machine"
    if reason in ("serving", "jobs"):  # ("jobs" with one left: it waited for serving's steps)
        return f"Waiting for compute: serving is busy; training gets {fraction:.0%} of the machine"
    if reason == "machine":
        return "Waiting for compute: other programs are using the machine's cores"
    return "No longer waiting for compute: the job trains at full speed"


class _Job:
    """What the runner keeps of a job while its worker runs."""

    def __init__(self, job_id: str, tenant: str, info: dict, trained: int):
        self.id, self.tenant, self.info = job_id, tenant, info
        self.model_name = info["model_name"]
        self.worker: TrainingWorker | None = None
        self.ready = False
        self.outcome: str | None = None
        self.billed = trained  # trained tokens counted in the tenant's usage so far
        # (step, when, seconds it had held the cores) as this worker's training started
        self.first_step: tuple[int, float, float] | None = None
        self.last: dict = {}  # the last metrics, for the next checkpoint
        self.pid: int | None = None  # its process, while it holds the serving engine's cores by its lease
        self.training = True  # until the worker says how its training ended


@dataclass
class _Validations:
    """A tenant's validations: running (as many as `turns` lets at once) or waiting their turn."""

    turns: anyio.Semaphore
    count: int = 0


class FineTuningRunner:
    def __init__(
        self,
        store: FineTuningStore,
        files: FileStore,
        adapters: AdapterStore,
        usage: UsageStore | None,
        settings: RunnerSettings | None = None,
        quotas: Quotas | None = None,
    ):
        self.store, self.files, self.adapters, self.usage = store, files, adapters, usage
        adapters.on_delete.append(store.model_deleted)  # a checkpoint's model deleted: no longer listed
        self.settings = settings or RunnerSettings()
        self.quotas = quotas or Quotas()  # what POST /v1/fine_tuning/jobs lets each tenant have
        if self.settings.max_running < 1 or self.settings.threads < 1:
            raise ValueError("--fine-tuning-max-running and --fine-tuning-threads must be at least 1")
        self._jobs: dict[str, _Job] = {}  # training: each holds a slot (--fine-tuning-max-running)
        self._evaluating: dict[str, anyio.CancelScope] = {}  # trained, their eval file being answered
        self._validations: set[str] = set()  # jobs whose files are being validated
        self._validating: dict[str, _Validations] = {}  # by tenant, while it has some
        self._last_start: dict[str, float] = {}
        self._wake = anyio.Event()
        self._tg: TaskGroup | None = None
        self._app = None  # the app a job's eval file is answered through
        self._run_files: Callable | None = None  # given by `run`
        self._recovered = False  # the jobs a restart cut short are queued again (`recover`)
        adapters.reserved_by(store.reserved_bytes)  # the room queued jobs' adapters will take

    # -- the API's side --------------------------------------------------------------------------------------
    def wake(self) -> None:
        """A job was queued or resumed."""
        self._wake.set()

    @contextlib.asynccontextmanager
    async def validation(self, tenant: str) -> AsyncIterator[None]:
        """One of the tenant's jobs being validated: at most `quotas.max_validating` of the tenant's at once (the
        next waits its turn; other tenants' never wait on them)."""
        mine = self._validating.setdefault(tenant, _Validations(anyio.Semaphore(self.quotas.max_validating)))
        mine.count += 1
        try:
            async with mine.turns:
                yield
        finally:
            mine.count -= 1
            if not mine.count:
                del self._validating[tenant]

    def stop(self, job_id: str, pause: bool) -> None:
        """The job was cancelled (or paused): its worker stops now (a pause: after its step, with a checkpoint); a
        cancelled job's eval stops now, its requests in flight aborted (a paused one's goes on: it has trained)."""
        if not pause and job_id in self._evaluating:
            self._evaluating[job_id].cancel()
        job = self._jobs.get(job_id)
        if job is None or job.worker is None:
            return
        if pause and job.ready:
            job.worker.pause()
        else:
            job.worker.kill()

    def _resumes_from(self, job_id: str) -> int | None:
        """The step of the checkpoint a job goes on from when it starts again (None: it starts over)."""
        path = last_checkpoint(self.store.run_dir(job_id) / CHECKPOINTS)
        return None if path is None else checkpoint_step(path)

    @property
    def validates_later(self) -> bool:
        """Whether a job's files can be validated after its create call answers (the runner's loop has started)."""
        return self._tg is not None

    def validate_later(self, job_id: str, tenant: str, cpu_s: float = 0.0) -> None:
        """The `validating_files` job's files validated beside the API (`cpu_s`: the CPU time its checks took so
        far); then it is queued, or failed with its files' error."""
        self._validations.add(job_id)
        self._tg.start_soon(self._validate, job_id, tenant, cpu_s)

    async def _validate(self, job_id: str, tenant: str, cpu_s: float) -> None:
        cpu, outcome, run_dir = [cpu_s], "refused", self.store.run_dir(job_id)
        try:
            async with self.validation(tenant):
                if await _thread(self.store.status, job_id) != "validating_files":
                    return  # cancelled meanwhile
                run = TrainingRun.of(json.loads(await _thread((run_dir / RUN_SPEC).read_text)))
                ids = await _thread(self.store.files_of, job_id)
                model = self._run_files(self._app.state.motet)
                prepare = functools.partial(prepare_job, self.files, model, run, tenant, ids)
                prepared = await _thread(cpu_timed(prepare, cpu))
            if await _thread(self.store.validated, job_id, prepared.examples, prepared.tokens, self.quotas,
                             validated_event(prepared)):  # fmt: skip
                outcome = "queued"
                self.wake()
        except FileError as e:
            refusal = Refusal.of(e, ids[e.which])
            await _thread(self.store.fail, job_id, refusal.code, refusal.message, refusal.param)
        except QuotaExceeded as e:
            await _thread(self.store.fail, job_id, e.code, str(e))
        except Exception as e:  # a failing disk, or a bug: this job fails, never the runner
            if await _thread(self.store.status, job_id) == "validating_files":
                log.exception("fine-tuning job %s: its files could not be validated", job_id)
                cause = e.cause if isinstance(e, StorageFailure) else type(e).__name__
                await _thread(self.store.fail, job_id, "server_error",
                              f"the job's files could not be validated on the server ({cause})")  # fmt: skip
        finally:
            self._validations.discard(job_id)
            self._app.state.motet.metrics.observe_fine_tuning_validation(tenant, outcome, cpu[0])
            with anyio.CancelScope(shield=True):
                if await _thread(self.store.status, job_id) in FINISHED:
                    await _thread(shutil.rmtree, run_dir, True)

    async def finished(self, job_id: str) -> None:
        """A job that ended without a worker (cancelled while queued, paused or evaluated): its run directory goes."""
        if job_id not in self._jobs and job_id not in self._validations:  # (a validation removes its own)
            await _thread(shutil.rmtree, self.store.run_dir(job_id), True)

    # -- the loop --------------------------------------------------------------------------------------------
    async def recover(self) -> bool:
        """Queue again the jobs a restart cut short, each with the event saying where it goes on from (once in a
        server's life). The app's start-up awaits it before the server answers, so a client reading a job after a
        restart never sees it `running` with no worker; False where the storage failed (`run` tries again)."""
        if not self._recovered:
            try:
                for job_id in await _thread(self.store.recover, self._resumes_from):
                    log.info("fine-tuning job %s: queued again after the restart", job_id)
            except StorageFailure as e:
                log.warning("fine-tuning: storage failed (%s); trying again in %gs", e.cause, POLL_S * 5)
                return False
            self._recovered = True
        return True

    async def run(self, app, run_files: Callable) -> None:
        """Run the jobs of `app` (`run_files(state)`: what training needs to know of its served model)."""
        self._app, self._run_files, state = app, run_files, app.state.motet
        while not await self.recover():
            await anyio.sleep(POLL_S * 5)
        while not state.system.ready:  # the model is loading
            await anyio.sleep(0.1)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for job_id, tenant in await _thread(self.store.validating):  # cut short by a restart: done again
                log.info("fine-tuning job %s: its files are validated again after the restart", job_id)
                self.validate_later(job_id, tenant)
            while True:
                if not state.draining:
                    try:
                        await self._start_next()
                    except StorageFailure as e:
                        log.warning("fine-tuning: storage failed (%s)", e.cause)
                with anyio.move_on_after(POLL_S):
                    await self._wake.wait()
                self._wake = anyio.Event()

    async def _start_next(self) -> None:
        while len(self._jobs) < self.settings.max_running:
            # (a job paused and resumed at once may still have its first worker finishing its step)
            queued = [q for q in await _thread(self.store.queued) if q.job_id not in self._jobs]
            running = Counter(job.tenant for job in self._jobs.values())
            chosen = next_job(queued, running, self._last_start)
            if chosen is None:
                return
            if not await _thread(self.store.start, chosen.job_id):
                continue  # paused or cancelled meanwhile
            info = await _thread(self.store.internals, chosen.job_id)
            trained = (await _thread(self.store.job, chosen.job_id))["trained_tokens"]
            self._jobs[chosen.job_id] = job = _Job(chosen.job_id, chosen.tenant, info, trained)
            self._last_start[chosen.tenant] = time.monotonic()
            self._tg.start_soon(self._drive, job)

    async def _drive(self, job: _Job) -> None:
        run_dir = self.store.run_dir(job.id)
        rc = None
        try:
            launch = self.settings.launch or LocalWorker.start
            async with self._starting(
                job.tenant
            ) as join:  # (a local worker: stopped until it holds the cores)
                job.worker = await launch(run_dir, self.settings.threads, self._nice())
                if (pid := getattr(job.worker, "pid", None)) is not None and join(pid):
                    job.pid = pid
            try:
                async with anyio.create_task_group() as watching:
                    if job.pid is not None:
                        watching.start_soon(self._watch_compute, job)
                    async for event in job.worker.events():
                        await self._on_event(job, event)
                    watching.cancel_scope.cancel()
                rc = await job.worker.wait()
            finally:
                with anyio.CancelScope(shield=True):  # the server stops: the worker goes with it
                    job.worker.kill()  # (SIGKILL ends it stopped or not)
                    await job.worker.wait()
                    if job.pid is not None:
                        self.settings.lease.leave(job.pid)
        except LaunchError as e:
            await self._fail(job, str(e))
        except Exception as e:  # a bug or a failing disk: this job fails, never the runner
            log.exception("fine-tuning job %s failed", job.id)
            await self._fail(job, f"the job failed on the server ({type(e).__name__})")
        finally:
            self._jobs.pop(job.id, None)
            self.wake()
        if job.outcome is None and rc is not None:
            status = await _thread(self.store.status, job.id)
            if status == "running":  # the worker died without a word (killed, or out of memory)
                await self._fail(job, f"the training process exited with code {rc} before the job finished")
        status = await _thread(self.store.status, job.id)
        if status == "failed":  # the operator's clue, before the run directory goes
            tail = await _thread(_tail, run_dir / "worker.log")
            log.warning("fine-tuning job %s failed (its worker exited with %s); the end of its log:\n%s", job.id, rc,
                        tail)  # fmt: skip
        if status in FINISHED:
            await _thread(shutil.rmtree, run_dir, True)

    def _nice(self) -> int:
        if self.settings.nice is not None:
            return self.settings.nice
        lease = self.settings.lease
        return LEASED_NICE if lease is not None and lease.shares_cores else UNLEASED_NICE

    def _starting(self, tenant: str) -> contextlib.AbstractAsyncContextManager[Callable[[int], bool]]:
        """Around a worker's start: the lease's (which stops a local worker until it holds the cores), or, without
        one, nothing."""
        if self.settings.lease is not None:
            return self.settings.lease.starting(tenant)
        return _unleased()

    async def _watch_compute(self, job: _Job) -> None:
        """While the job trains, its events say when its worker starts to wait for compute (it held the cores, or
        its threads ran, little of the last WAIT_WINDOW_S: motet/training/compute_share.py), and when it no
        longer does; one event each, not one a slice."""
        lease = self.settings.lease
        samples: deque = deque(maxlen=round(WAIT_WINDOW_S / POLL_S) + 1)
        said = None
        while (sample := lease.sample(job.pid)) is not None:
            samples.append(sample)
            if len(samples) == samples.maxlen:
                reason = waiting_reason(samples[0], samples[-1])
                if reason != said and job.training:
                    said = reason
                    fraction = lease.fraction(job.pid, busy=reason == "serving")
                    message = _compute_message(reason, fraction, lease.workers)
                    await _thread(self.store.add_event, job.id, message)
            await anyio.sleep(POLL_S)

    def _estimated_finish(self, job: _Job, step: int, total: int, now: float) -> int | None:
        """When the job should end: the steps left at its pace since its training started (in seconds it held
        the cores, over the share of the machine it gets now, for a worker on the lease; else in wall seconds);
        None before its first step here."""
        if job.first_step is None or (done := step - job.first_step[0]) <= 0:
            return None
        if job.pid is None:
            return int(now + (total - step) * (now - job.first_step[1]) / done)
        lease = self.settings.lease
        fraction = lease.fraction(job.pid)
        if fraction <= 0:  # (--fine-tuning-share 0 while serving is busy: when it will be idle is unknown)
            return None
        per_step = (lease.held_s(job.pid) - job.first_step[2]) / done
        return int(now + (total - step) * per_step / fraction)

    async def _fail(self, job: _Job, message: str) -> None:
        try:
            await _thread(self.store.fail, job.id, "training_failed", message)
        except Exception:
            log.exception("fine-tuning job %s could not be marked failed", job.id)

    # -- what the worker says ----------------------------------------------------------------------------------
    async def _on_event(self, job: _Job, event: dict) -> None:
        kind = event.get("type")
        if kind == "ready":
            job.ready = True
            if (
                await _thread(self.store.status, job.id) != "running"
            ):  # paused or cancelled before it was ready
                job.worker.kill()
        elif kind == "placed":  # (a Ray Train run's: where it trains)
            await _thread(self.store.add_event, job.id, f"Training on {event['where']}")
        elif kind == "started":
            total = event["total_steps"]
            held = self.settings.lease.held_s(job.pid) if job.pid is not None else 0.0
            job.first_step = (event["step"], time.time(), held)
            await _thread(self.store.progress, job.id, event["step"], total, job.billed, None)
            if event["step"] == 0:
                await _thread(self.store.add_event, job.id, "Fine-tuning job started")
        elif kind == "resumed":
            message = f"Going on from the checkpoint of step {event['step']}"
            await _thread(self.store.add_event, job.id, message)
            if event["epoch_end"]:  # stored already, unless the server stopped right after it was saved
                await self._checkpoint(job, event)
        elif kind == "step":
            await self._step(job, event)
        elif kind == "validation":
            data = {k: event[k] for k in ("step", "valid_loss", "valid_mean_token_accuracy")}
            job.last.update(data)
            message = f"Step {event['step']}: validation loss={event['valid_loss']:.4f}"
            await _thread(self.store.add_event, job.id, message, "info", "metrics", data)
        elif kind == "checkpoint" and event["epoch_end"]:
            await self._checkpoint(job, event)
        elif kind == "succeeded":
            job.training = False
            await self._succeed(job, event)
        elif kind == "paused":
            job.training = False
            job.outcome = "paused"
            await _thread(
                self.store.add_event, job.id, "The job is paused: it goes on from here when resumed"
            )
        elif kind == "failed":
            job.training = False
            job.outcome = "failed"
            await self._fail(job, event.get("message", "the training failed"))

    async def _step(self, job: _Job, event: dict) -> None:
        step, total = event["step"], event["total_steps"]
        finish = self._estimated_finish(job, step, total, time.time())
        data = {k: event.get(k) for k in ("step", "train_loss", "train_mean_token_accuracy")} | {
            "total_steps": total
        }
        job.last = {k: v for k, v in data.items() if k != "total_steps"}
        await _thread(self.store.progress, job.id, step, total, event["trained_tokens"], finish)
        message = f"Step {step}/{total}: training loss={event['train_loss']:.4f}"
        await _thread(self.store.add_event, job.id, message, "info", "metrics", data)
        self._bill(job, event["trained_tokens"])

    async def _evaluate(self, job: _Job, rows: list[dict], step: int) -> None:
        """The job's eval file answered by its model and by the model it was tuned from, greedily, through the
        server's own route as the tenant (billed as its requests), one request at a time; the counts an event."""
        models = {"fine_tuned": job.model_name, "base": job.info["model"]}
        await _thread(self.store.add_event, job.id, f"Evaluating {job.model_name} and {job.info['model']} on the "
                      f"eval file ({len(rows)} examples, greedy)")  # fmt: skip
        data: dict = {"step": step, "examples": len(rows)}
        for which, model in models.items():
            matched = failed = 0
            for row in rows:
                message = await chat_answer(self._app, job.tenant, model, row)
                failed += message is None
                matched += message is not None and same_answer(row, message)
            data[f"{which}_matched"], data[f"{which}_failed_requests"] = matched, failed
        n = max(len(rows), 1)
        message = (f"Eval file: {job.model_name} gave {data['fine_tuned_matched']} of {len(rows)} answers "
                   f"({100 * data['fine_tuned_matched'] / n:.1f}%), {job.info['model']} "
                   f"{data['base_matched']} ({100 * data['base_matched'] / n:.1f}%)")  # fmt: skip
        if data["fine_tuned_failed_requests"] or data["base_failed_requests"]:
            message += (f"; {data['fine_tuned_failed_requests'] + data['base_failed_requests']} requests were not "
                        "answered")  # fmt: skip
        await _thread(self.store.add_event, job.id, message, "info", "metrics", data)

    def _bill(self, job: _Job, trained: int) -> None:
        if self.usage is not None and trained > job.billed:
            self.usage.add_training(job.tenant, job.model_name, trained - job.billed)
            job.billed = trained

    async def _checkpoint(self, job: _Job, event: dict) -> None:
        # said again after a restart: stored already (and not again if the tenant has deleted its model since)
        if await _thread(self.store.has_checkpoint, job.id, event["step"]):
            return
        model = checkpoint_model(job.model_name, event["step"])
        try:
            await self.adapters.add_fine_tuned(job.tenant, model, Path(event["path"]), job.id)
        except APIError as e:  # a checkpoint that cannot be served (it should always be): said, not fatal
            await _thread(self.store.add_event, job.id, f"Checkpoint at step {event['step']} not stored: {e}",
                          "warn")  # fmt: skip
            return
        metrics = {"step": event["step"], **job.last, "full_valid_loss": job.last.get("valid_loss"),
                   "full_valid_mean_token_accuracy": job.last.get("valid_mean_token_accuracy")}  # fmt: skip
        await _thread(self.store.add_checkpoint, job.id, event["step"], model, metrics)

    async def _succeed(self, job: _Job, event: dict) -> None:
        job.outcome = "succeeded"
        try:
            await self.adapters.add_fine_tuned(job.tenant, job.model_name, Path(event["path"]), job.id)
        except APIError as e:
            await self._fail(job, f"the trained adapter could not be stored: {e.message}")
            return
        await _thread(self.store.model_stored, job.id)
        eval_path = self.store.run_dir(job.id) / EVAL_ROWS
        if not eval_path.is_file():
            await self._finish(job, event)
            return
        rows = await _thread(read_rows, eval_path)
        scope = self._evaluating[job.id] = anyio.CancelScope()  # from here a cancel (`stop`) stops it
        if await _thread(self.store.status, job.id) not in ("running", "paused"):  # cancelled meanwhile
            del self._evaluating[job.id]
            return
        # beside the training slots: this job's frees as its worker exits, while its eval goes on
        self._tg.start_soon(self._evaluate_and_finish, job, rows, event, scope)

    async def _evaluate_and_finish(self, job: _Job, rows: list[dict], event: dict, scope: anyio.CancelScope):
        """The job's eval file answered, then the job succeeds; cancelled with the job (`stop`)."""
        try:
            with scope:
                await self._evaluate(job, rows, event["step"])
                await self._finish(job, event)
        except Exception:  # a bug or a failing disk: this job fails, never the runner
            log.exception("fine-tuning job %s failed", job.id)
            await self._fail(job, "the job failed on the server while answering its eval file")
        finally:
            del self._evaluating[job.id]
        if await _thread(self.store.status, job.id) in FINISHED:
            await _thread(shutil.rmtree, self.store.run_dir(job.id), True)

    async def _finish(self, job: _Job, event: dict) -> None:
        def write_results() -> str:
            file_id = result_file_id(job.id)
            data = results_csv(self.store.metrics(job.id))
            self.files.put(file_id, job.tenant, "step_metrics.csv", "fine-tune-results", [data])
            return file_id

        file_id = await _thread(write_results)
        self._bill(job, event["trained_tokens"])
        await _thread(self.store.succeed, job.id, event["trained_tokens"], [file_id])
