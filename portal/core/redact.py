"""What one team may be told of a GPU node that another team's work ran on.

Health reports and the reasons a node is out of service came to name processes: agents before the
reports counted them listed stray processes' ids (": pids [4242, 5353]"), and a kernel log's XID line
names the process that hit it ("pid=48213, name=train.py, "). Those are the work of whichever team
was on the node. Whatever stored text a tenant reads (a check's messages, a node's state reason, a
notice to its channels) goes through ``without_processes``; staff read the text as stored.

Plain Python: every app may use it (the health library keeps its own copy of the XID pattern for
the node agent, which imports no portal code; a test checks the two agree).
"""

from __future__ import annotations

import re

__all__ = ["XID_PROCESS", "without_processes"]

# The process an XID line names: "pid=48213, name=train.py, " ("pid='<unknown>', name=<unknown>, " when none).
XID_PROCESS = re.compile(r"\bpid=[^,]*,\s*name=[^,]*(?:,\s*|$)")
# A list of process ids, as agents before the reports counted processes named stray ones (": pids [4242, 5353]").
_PID_LIST = re.compile(r":?\s*\bpids?\s*\[[^\]]*\]")


def without_processes(text: str) -> str:
    """Return text without any process it names (ids, "pid=…, name=…")."""
    return _PID_LIST.sub("", XID_PROCESS.sub("", text)).strip()
