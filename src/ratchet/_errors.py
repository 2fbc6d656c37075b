"""The exception hierarchy, in one place: everything ratchet raises on purpose is below.

    RatchetError                      catch this to handle anything ratchet raised on purpose
    ├── ConfigError                   a setting, agent, flag or file is wrong; exit 2
    │   ├── InvalidArgumentError      (also ValueError) an API argument whose value is unusable
    │   ├── InvalidTypeError          (also TypeError) an API argument of the wrong type
    │   ├── PromptArgumentError       (also ChatError) a prompt formatted without an argument
    │   ├── ProjectError              (also ValueError) a checks project file or plan is invalid
    │   └── ServerUnreachableError    a connector's server cannot be reached (at start, or lost)
    ├── StateError                    a state directory cannot be used as it is; exit 2
    │   ├── StateInUseError           another process holds the state directory's lock
    │   ├── StateWriteError           the disk holding the state is full or failed a write
    │   ├── ReceiptError              (also ValueError) a checks receipt cannot be trusted
    │   │   └── LegacyReceiptError    a receipt from before checkpoints: grants no reuse
    │   └── ResumeRefusedError        (also ValueError) a checks run cannot be resumed as it is
    ├── BadInputError                 an input record cannot be admitted; exit 3
    ├── NonDeterminismError           replay met a different call than the journal recorded
    │   └── IncompatibleChangeError   a run in flight cannot be replayed by the new agent; exit 2
    ├── MigrationError                a memory migration is missing or raised; exit 2
    ├── SignalTimeout                 (also TimeoutError) ctx.wait_for_signal timed out
    ├── CheckpointError               checkpoints failed more times in a row than tolerated
    ├── SinkError                     a job ends with outputs its sink would not take; exit 1
    ├── CodecError                    (also TypeError) a value cannot be stored
    │   └── UnknownTypeError          stored data names a class this process has not registered
    ├── CorruptDataError              (also ValueError) bytes are not something encode wrote
    ├── ReplayedCallError             base of the stand-in for a replayed unregistered exception
    ├── ChatError                     the chat layer
    │   ├── ModelCallError            a provider refused or failed a request
    │   ├── TurnLimitError            the tool loop reached max_turns
    │   ├── TokenBudgetExceededError  a run or key used up its token budget
    │   └── StructuredOutputError     a reply does not validate against the requested schema
    ├── StageTimeoutError             a check stage ran past its timeout
    └── InternalError                 a broken invariant inside ratchet: a bug, please report it

Errors from lower layers (sqlite3, OSError, pydantic) are translated at the boundary with
``raise ... from exc``, so the original stays attached. Exit codes are the constants below,
shared by the CLI and the supervisor (which does not restart a worker that exited with one a
restart cannot fix).
"""

from __future__ import annotations

TYPE_CHECKING = False  # `typing` is for the type checker: not imported at start-up
if TYPE_CHECKING:
    from typing import Final

# -- exit codes of `ratchet` (documented in README "Exit codes") ---------------------------------
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # the work ran and failed (a check failed, a supervised job gave up, a sink)
EXIT_USAGE: Final = 2  # a ConfigError/StateError or any other RatchetError: fix and run again
EXIT_BAD_INPUT: Final = 3  # an input line was refused; everything before it is committed
EXIT_ERRORS: Final = 4  # the job ran, and runs ended in error (--allow-errors; --max-errors)
EXIT_INTERRUPTED: Final = 130  # Ctrl-C
# A worker that exits with one of these hit an error a restart cannot fix.
EXIT_NO_RESTART: Final = frozenset({EXIT_USAGE, EXIT_BAD_INPUT, EXIT_ERRORS})


# What an IncompatibleChangeError offers (docs/runtime.md, "Upgrading an agent").
UPGRADE_FIXES: Final = (
    "Fixes: run the previous agent version until the run completes; branch the changed code "
    "with ctx.patched(...) so the recorded run takes its old path; or stop the job and "
    "`ratchet runs restart --state DIR --key KEY` (the run starts again from its input; calls "
    "it made may be made again) or `ratchet runs abandon --state DIR --key KEY` (its input "
    "goes to the dead letters). See docs/runtime.md, 'Upgrading an agent'"
)


def exit_code_for(exc: BaseException) -> int:
    """The exit code the CLI uses for an error that ends a command."""
    if isinstance(exc, BadInputError):
        return EXIT_BAD_INPUT
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, SinkError):  # not a mistake to fix: the sink was down; a restart helps
        return EXIT_FAILED
    return EXIT_USAGE


class RatchetError(Exception):
    """Root of ratchet's errors; catch this to handle anything ratchet raised on purpose."""


class ConfigError(RatchetError):
    """A user-supplied setting, agent or file is wrong; the message names it and the fix."""


class ServerUnreachableError(ConfigError):
    """A connector's server cannot be reached at start: nothing listens at its address, its
    name does not resolve, it does not answer in time, or it is starting up or shutting down;
    or a source lost it mid-run and cannot go on without it (the next start resumes from the
    last checkpoint). It did not say no (a wrong password, a missing table or stream is a plain ConfigError), so
    trying again later may succeed: `ratchet run --supervise` restarts its worker, within the
    restart policy, until it can be reached. `server` is what it is ("PostgreSQL", "NATS"),
    `address` where ("HOST:PORT")."""

    def __init__(self, message: str, *, server: str, address: str) -> None:
        super().__init__(message)
        self.server = server
        self.address = address


class InvalidArgumentError(ConfigError, ValueError):
    """A ratchet API got an argument whose value it cannot use (a memory path with an empty
    segment, a name already taken); the message names the argument and what to pass."""


class InvalidTypeError(ConfigError, TypeError):
    """A ratchet API got an argument of the wrong type (`send_event` of a non-event, a sync
    action returning an awaitable); the message names the argument and what to pass."""


class StateError(RatchetError):
    """A state directory cannot be used as it is (wrong schema, corrupt, locked, wrong agent)."""


class StateInUseError(StateError):
    """Another process holds the state directory's lock (`holder`, e.g. "pid 123"): a job, or a
    command that needs the job stopped. Trying again once it is gone may succeed."""

    def __init__(self, message: str, holder: str = "another process") -> None:
        super().__init__(message)
        self.holder = holder


class StateWriteError(StateError):
    """The disk holding a state directory (`state_dir`) is full (`disk_full`), or failed an
    I/O operation (a file size limit, a failing device). Not damage: SQLite rolled the failed
    write back, so what was committed is kept; the fix is the disk's, then the same command
    again. `problem` is the first half of the message, `fix` the second (the engine puts its
    own words between them)."""

    def __init__(self, problem: str, fix: str, *, state_dir: str, disk_full: bool) -> None:
        super().__init__(f"{problem}: {fix}")
        self.problem = problem
        self.fix = fix
        self.state_dir = state_dir
        self.disk_full = disk_full


class NonDeterminismError(RatchetError):
    """Replay found a different call where the journal recorded one; the agent code changed."""


class IncompatibleChangeError(NonDeterminismError):
    """A run in flight has a journal the upgraded agent cannot replay; the message names the
    key, the run, the task and the change, and the fixes (`ctx.patched`, `ratchet runs
    restart`, `ratchet runs abandon`, or the old code until the run completes)."""


class MigrationError(RatchetError):
    """A key's memory cannot be brought to the agent's `memory_version`: a migration is
    missing or raised. Nothing of that key was written; the message names the key and version."""


class SignalTimeout(RatchetError, TimeoutError):
    """`ctx.wait_for_signal(name, timeout=...)` reached its timeout without the signal.

    Raised into the waiting action (catch it there); an uncaught one fails the action like
    any exception. After a crash the same wait times out at the same recorded deadline."""


class CheckpointError(RatchetError):
    """Checkpoints failed more times in a row than the job tolerates."""


class SinkError(RatchetError):
    """A job ends with outputs of completed checkpoints its sink would not take (they are
    kept in the state and written when the job runs again)."""


class BadInputError(RatchetError):
    """An input record cannot be admitted (invalid JSON, missing key field)."""


class InternalError(RatchetError):
    """A broken invariant inside ratchet: a bug, please report it."""


# -- the codec -----------------------------------------------------------------------------------


class CodecError(RatchetError, TypeError):
    """A value cannot be stored: the message names where it is, its type, and what to use."""


class UnknownTypeError(CodecError):
    """Stored data names a registered class that this process has not registered."""


class CorruptDataError(RatchetError, ValueError):
    """Bytes given to `decode` are not something `encode` wrote (truncated, damaged, foreign)."""


# -- durable calls -------------------------------------------------------------------------------


class ReplayedCallError(RatchetError):
    """A durable call failed before a crash with an exception of an unregistered class.

    Built-in and registered exception classes are re-raised as themselves; any other comes
    back as a stand-in class deriving from this one and from the original's built-in bases
    (so `except RuntimeError` still catches it), carrying the original type name and message.
    """

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message


# -- the chat layer ------------------------------------------------------------------------------


class ChatError(RatchetError):
    """Root of the chat layer's errors."""


class PromptArgumentError(ChatError, ConfigError):
    """A prompt was formatted without one of its named arguments."""


class ModelCallError(ChatError):
    """A provider refused or failed a request.

    `transient` says whether a retry may succeed (429, 5xx, timeouts, dropped connections);
    `status` is the HTTP status when there was one; `retry_after` is the server's hint in
    seconds. The message carries the provider's own message.
    """

    def __init__(
        self,
        message: str,
        *,
        provider: str = "",
        status: int | None = None,
        transient: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.provider = provider
        self.status = status
        self.transient = transient
        self.retry_after = retry_after


class TurnLimitError(ChatError):
    """The tool loop called the model `max_turns` times without a final reply."""


class TokenBudgetExceededError(ChatError):
    """A run or a key used up its token budget; no further model call is made."""


class StructuredOutputError(ChatError):
    """The model's reply does not validate against the requested output schema."""


# -- the check runner ----------------------------------------------------------------------------
# Where the checks contract asks for a ValueError the classes subclass it too.


class ProjectError(ConfigError, ValueError):
    """The project file (or a hand-built plan) is invalid; the message names the field."""


class ReceiptError(StateError, ValueError):
    """A receipt cannot be trusted: missing, unreadable, or its seal does not match."""


class LegacyReceiptError(ReceiptError):
    """A receipt written before checkpoints existed: it grants no reuse."""


class ResumeRefusedError(StateError, ValueError):
    """A run cannot be resumed from this receipt as it stands (e.g. it is still `running`)."""


class StageTimeoutError(RatchetError):
    """A stage ran past its `timeout_seconds`; its process group was killed."""
