"""What one team may be told of a GPU node that another team's work ran on.

Health reports and the reasons a node is out of service came to name processes: agents before the
reports counted them listed stray processes' ids (": pids [4242, 5353]"), and a kernel log's XID line
names the process that hit it ("pid=48213, name=train.py, "). Those are the work of whichever team
was on the node. Whatever stored text a tenant reads (a check's messages, a node's state reason, a
notice to its channels) goes through ``without_processes``; staff read the text as stored.

A backend's error (Slurm or Kubernetes command output, an exception's text) may carry credentials: a URL
with a password in it, a bearer token, ``password=…``, a key. Whatever of such an error a team is told (a
cluster's reason on its page, in the API, in its Slack channel) goes through ``without_secrets``; the full
text stays in the log and in the admin (a cluster's ``last_error``).

Plain Python: every app may use it (the health library keeps its own copy of the XID pattern for
the node agent, which imports no portal code; a test checks the two agree).
"""

from __future__ import annotations

import re

__all__ = ["SECRET", "XID_PROCESS", "without_processes", "without_secrets"]

# The process an XID line names: "pid=48213, name=train.py, " ("pid='<unknown>', name=<unknown>, " when none).
XID_PROCESS = re.compile(r"\bpid=[^,]*,\s*name=[^,]*(?:,\s*|$)")
# A list of process ids, as agents before the reports counted processes named stray ones (": pids [4242, 5353]").
_PID_LIST = re.compile(r":?\s*\bpids?\s*\[[^\]]*\]")


def without_processes(text: str) -> str:
    """Return text without any process it names (ids, "pid=…, name=…")."""
    return _PID_LIST.sub("", XID_PROCESS.sub("", text)).strip()


SECRET = "[redacted]"
# A URL's userinfo: "https://admin:hunter2@k8s.example/…" (the user alone may be a token too).
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@?#]+@")
# A PEM block: a private key or a certificate pasted into an error.
_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?(?:-----END [A-Z0-9 ]+-----|$)", re.DOTALL)
# "Authorization: Bearer eyJ…", "Basic dXNlcjpwYXNz", "token abc…".
# After "basic"/"token" only what looks like a secret (a digit in it, or long), not "token expired".
_SCHEME_TOKEN = re.compile(r"(?i)\b(bearer(?=\s+[A-Za-z0-9._~+/=-]{6,})|basic|token)(\s+)"
                           r"(?:(?=[A-Za-z0-9._~+/=-]*\d)[A-Za-z0-9._~+/=-]{6,}|[A-Za-z0-9._~+/=-]{20,}"
                           r"|(?<=[Bb][Ee][Aa][Rr][Ee][Rr] )[A-Za-z0-9._~+/=-]{6,})")
_SCHEMES = frozenset({"bearer", "basic", "token"})
# key=value / key: value / "key": "value" where the key names a secret.
_SECRET_KEY = (r"(?:[A-Za-z0-9_.-]*(?:passw(?:or)?d|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key"
               r"|credential|signature)[A-Za-z0-9_.-]*|[A-Za-z0-9_.-]*auth(?:orization)?)")
# A key is a word of its own: not a URL's path segment ("…/serviceaccounts/y/token": dial tcp …, as Go quotes the
# URL it failed on), nor the tail of a longer name.
_KEY_VALUE = re.compile(
    r"(?i)((?<![\w/.-])" + _SECRET_KEY + r"[\"']?\s*[=:]\s*)(?!\[redacted\])(\"[^\"]*\"|'[^']*'|[^\s&,;\"'}\]]+)")
# A word that says whether or how a credential was used, not the credential: "(using password: YES)",
# "Invalid credential: Expired credential", "token: missing".
_NOT_A_SECRET = re.compile(r"(?i)(?:yes|no|true|false|none|null|nil|empty|missing|required|invalid|expired"
                           r"|revoked|unknown|denied|rejected)\)?")
# A JSON Web Token, then long runs of hex or base64 (keys, signatures), with at least one digit in them.
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*")
_LONG_HEX = re.compile(r"\b[0-9a-fA-F]{32,}\b")
_LONG_B64 = re.compile(r"(?<![A-Za-z0-9+/_=-])(?=[A-Za-z0-9+/_-]*\d)(?=[A-Za-z0-9+/_-]*[A-Za-z])"
                       r"[A-Za-z0-9+/_-]{40,}={0,2}(?![A-Za-z0-9+/_=-])")


def _b64_secret(match: re.Match[str]) -> str:
    # A run with "/" in it may be a path or a URL's ("/var/lib/kubelet/pods/…", "6443/apis/apps/v1/…"), one with "-"
    # or "_" a name the backends are told (a namespace tenant-<slug>-r<id>, a volume, a Slurm reservation, a node's
    # hostname): those are of one case or start with "/"; a base64 key mixes cases and digits.
    run = match.group()
    one_case = not (re.search(r"[a-z]", run) and re.search(r"[A-Z]", run))
    if run.startswith("/") or (one_case and re.search(r"[/_-]", run)):
        return run
    return SECRET


def _key_value_secret(match: re.Match[str]) -> str:
    # "Authorization: Bearer [redacted]" keeps its scheme word (the token after it is already gone).
    value = match.group(2)
    if value.lower() in _SCHEMES or _NOT_A_SECRET.fullmatch(value):
        return match.group(0)
    return match.group(1) + SECRET


# A reason a team reads is a line or two; the rest is in the log and the admin.
MAX_TOLD = 500


def without_secrets(text: str, limit: int | None = MAX_TOLD) -> str:
    """Return a backend's error text without the credentials it may carry, at most limit characters.

    URL userinfo, bearer/basic tokens, ``password=…``-style values, PEM blocks, JWTs and long hex or
    base64 strings become ``[redacted]``; hostnames, paths and the words around them stay, so the
    message still says what failed. A longer text ends in "…".
    """
    text = _PEM.sub(SECRET, str(text))
    text = _URL_USERINFO.sub(lambda m: f"{m.group(1)}{SECRET}@", text)
    text = _SCHEME_TOKEN.sub(lambda m: f"{m.group(1)}{m.group(2)}{SECRET}", text)
    text = _KEY_VALUE.sub(_key_value_secret, text)
    text = _JWT.sub(SECRET, text)
    text = _LONG_HEX.sub(SECRET, text)
    text = _LONG_B64.sub(_b64_secret, text)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text
