"""`motet run-batch -i in.jsonl -o out.jsonl`: a batch file run offline, as `vllm run-batch` does.

The engine runs in this process behind the server's own app, without HTTP: the serving system is started as
`motet serve` starts it, and each line is sent to its url through the app (motet/api/batches/runner.py
`answer`), so a line gets exactly what the same request to a server would, with the same validation. The
formats are the Batch API's (motet/api/batches/lines.py). Unlike the server's batches, lines run at full
speed (up to `--max-concurrency` at once) and every answer, errors included, goes to the one output file, in
the input's order, as vLLM writes it. The output is written whole (to a temporary name, then renamed).
-i and -o take local paths, or http(s) URLs (the input is fetched with GET, the output sent with PUT:
motet/api/batch_files.py).
"""

from __future__ import annotations

import logging
import sys

import anyio
from tqdm import tqdm

from motet.api.batch_files import read_input, write_output
from motet.api.batches.lines import Line, dumps, error_line, parse_lines, succeeded
from motet.api.batches.runner import answer

log = logging.getLogger("motet.batches")


async def run_lines(app, lines: list[Line], concurrency: int, progress: tqdm) -> list[dict]:
    """Every line's answer, in the input's order."""
    out: list[dict | None] = [None] * len(lines)
    limiter = anyio.Semaphore(concurrency)

    async def run(i: int, line: Line) -> None:
        async with limiter:
            while isinstance(result := await answer(app, line.url, line.custom_id, line.body), float):
                await anyio.sleep(result)  # the queue is full: wait as the server said
        out[i] = result
        progress.update()

    async with anyio.create_task_group() as tg:
        for i, line in enumerate(lines):
            if line.error is not None:
                out[i] = error_line(line.custom_id, *line.error)
                progress.update()
            else:
                tg.start_soon(run, i, line)
    return out


async def _main(state, app, lines: list[Line], concurrency: int, on_ready=None) -> list[dict]:
    async with anyio.create_task_group() as tg:
        tg.start_soon(state.system.run)
        while not state.system.ready:
            await anyio.sleep(0.05)
        if on_ready is not None:
            on_ready()
        try:
            with tqdm(total=len(lines), unit="req", desc="Running batch", file=sys.stderr) as progress:
                return await run_lines(app, lines, concurrency, progress)
        finally:
            with anyio.move_on_after(10, shield=True):
                await state.system.stop()
            tg.cancel_scope.cancel()


def run_batch(args, config, on_ready=None) -> int:
    """The batch run (logging configured by the command); `on_ready()` once the engine has loaded, before the bar."""
    from motet.actors.system import ServingSystem
    from motet.api.app import create_app
    from motet.api.served_names import served_names, shared_loras
    from motet.api.state import ServerState
    from motet.engine.llm_engine import LLMEngine

    concurrency = args.max_concurrency or 2 * config.max_num_seqs
    lines = list(parse_lines(read_input(args.input_file)))
    names = served_names(args, config)
    system = ServingSystem(
        lambda: LLMEngine(config), max_queue_len=concurrency, loras=shared_loras(args.lora, names)
    )
    state = ServerState(
        system=system,
        model_names=names,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=getattr(args, "tool_call_parser", None),
    )
    log.info("running %d requests from %s on %s", len(lines), args.input_file, state.model_name)
    out = anyio.run(_main, state, create_app(state), lines, concurrency, on_ready)
    write_output(args.output_file, [dumps(result) for result in out])
    failed = sum(not succeeded(result) for result in out)
    log.info("wrote %d answers to %s (%d errors)", len(out), args.output_file, failed)
    return 0
