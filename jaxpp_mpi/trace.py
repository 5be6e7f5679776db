"""Pipeline timelines as Chrome-trace JSON: `record` a step, `export` every rank's events.

Open the file in https://ui.perfetto.dev or chrome://tracing; draw it with
`python -m jaxpp_mpi.schedules --from-trace FILE --png OUT.png`.
"""

from jaxpp_mpi._src.runtime.trace_export import export as export
from jaxpp_mpi._src.schedules.tasks import TaskPart as TaskPart
from jaxpp_mpi._src.schedules.tasks import parse_label as parse_label
from jaxpp_mpi._src.timeline.chrome import chrome_trace as chrome_trace
from jaxpp_mpi._src.timeline.chrome import load as load
from jaxpp_mpi._src.timeline.chrome import record as record
from jaxpp_mpi._src.timeline.timing import TraceEvent as TraceEvent

__all__ = ["TaskPart", "TraceEvent", "chrome_trace", "export", "load", "parse_label", "record"]
