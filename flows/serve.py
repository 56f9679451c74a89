"""Serve the deployments of this project (run by `ggpo up`): `ggpo/offline` (the offline
comparison, flows/offline.py) and `ggpo/online` (Algorithm 1, flows/online.py), one process.

Each deployment run goes through the Prefect outage handling `ggpo run` installs
(pipeline/services/prefect_client.py): a Prefect server that goes away mid-run costs one
warning line in serve.log, the run goes on to its end, and its final state is kept for
`ggpo up` to tell the restarted server. Prefect's runner starts each flow run in a process
of its own (the flows are served from memory, Runner.add_flow: a spawned subprocess), so
the handling is installed there, by the flows' `on_running` hook, as the run starts; the
client's bounded retries (prefect_client.settings) reach that process through the
environment. The serve process itself keeps Prefect's own client: it outlives a server
restart, and prefect_client's "gone for the rest of the process" must not hold for it.

The imports are inside main(): a flow run's process, and the grading workers it spawns,
import this module again (multiprocessing's spawn re-imports the main module), and need
none of it.
"""
from __future__ import annotations

import logging

SUSPENSION_NOISE = "Suspension polling task failed"


class SuspensionPollingGone(logging.Filter):
    """Drops the error (with its traceback) of the suspension observer Prefect runs beside a
    deployment's flow run only (flow_engine: observe_flow_run_suspension) once its server is
    gone, as prefect_client's filter drops Prefect's other records about a gone server (its
    message names no connection, and its exception, "Service exceeded error threshold",
    carries none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(SUSPENSION_NOISE):
            return True
        from pipeline.services import prefect_client
        if prefect_client.gone():
            prefect_client.mark_down()      # said once, if not yet
            return False
        return True


def outage_handling(flow, flow_run, state) -> None:
    """The flows' on_running hook, in the flow run's own process: prefect_client.install()
    (what `ggpo run` calls before its flow; idempotent), and the filter for the one record
    only a deployment run has."""
    from pipeline.services import prefect_client
    prefect_client.install()
    quiet = SuspensionPollingGone()
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
                                       if name.startswith("prefect")]
    for handler in {h for lg in loggers for h in lg.handlers}:
        handler.addFilter(quiet)


def main() -> None:
    import asyncio

    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner

    from flows.corrections import ggpo_corrections
    from flows.offline import ggpo
    from flows.online import ggpo_online
    from pipeline.services import prefect_client
    runner = Runner(pause_on_shutdown=True, limit=None)     # as prefect.serve() makes it
    for flow, name, preset in ((ggpo, "offline", "tiny"), (ggpo_online, "online", "tiny-online"),
                               (ggpo_corrections, "corrections", "corrections")):
        runner.add_flow(flow.with_options(on_running=[outage_handling]), name=name,
                        parameters={"preset": preset, "overrides": {}, "force": []})
    # after this process's own `import prefect` (its client keeps Prefect's retries): for
    # the flow runs' processes, which read it at theirs
    prefect_client.settings()
    print("ggpo: serving the deployments ggpo/offline, ggpo/online and ggpo/corrections", flush=True)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal):
        pass


if __name__ == "__main__":
    main()
