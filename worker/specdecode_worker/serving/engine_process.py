"""The engine in a process of its own, and the ``EngineService`` the HTTP front end holds for it.

Why apart: in one process, parsing, chat templates, tokenising, detokenising and streaming take
the interpreter lock from the engine's loop between its kernels, and the model waits. The front
end (``EngineProcess``) keeps all of that; the engine process runs the scheduler and the model.

The wire is a ``multiprocessing`` pipe of tuples of plain values (pickled):

- front end to engine: ``submit``, ``abort``, ``report`` (a numbered question) and ``stop``;
- engine to front end: ``started`` (the limits a request is checked against) or ``failed``
  (the start-up's error), then one ``updates`` message per step, whose entries are ``tokens`` (a
  request's new tokens and their logprobs, as the scheduler committed them) and ``end`` (its
  finish, error and counters), and ``report``: an answer, or, while it starts, one at each
  phase, unasked. One message per step, not per request: each message wakes the front end, and
  on a small CPU a wake-up takes a core from the engine's threads.

The engine process ignores SIGINT and SIGTERM: the front end drains first, then sends ``stop``.
It exits when the front end's end of the pipe closes, so a killed front end leaves no engine
behind. An engine process that dies fails every open request, and the front end reports the crash
(``on_crash``) so that the server answers 503 and exits non-zero.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..engine.args import EngineArgs
from ..engine.phases import Phase, PhaseError, StartupError
from ..engine.request import Request, TokenLogprob, check_request
from ..engine.service import EngineReport
from ..engine.stats import Stats
from ..errors import InputError

log = logging.getLogger(__name__)

SUBMIT, ABORT, REPORT, STOP = "submit", "abort", "report", "stop"
STARTED, FAILED, UPDATES = "started", "failed", "updates"
TOKENS, END = "tokens", "end"  # the entries of an ``updates`` message

# The Request fields a submission carries beyond its prompt and parameters, and those an ending
# brings back (usage and the metrics read them).
OPTIONS = ("eos_token_ids", "speculative", "max_draft_tokens", "cache_prompt")
COUNTERS = ("cached_tokens", "accepted_draft_tokens", "proposed_draft_tokens", "kept_draft_tokens",
            "verify_rounds", "retractions")
REPORT_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 40.0  # the engine's own stop joins its loop for up to 30 s

# How a start-up error crosses the pipe: its class by name, so the exit code stays the same.
_ERRORS: dict[str, type[Exception]] = {"StartupError": StartupError, "InputError": InputError}


def in_own_process() -> bool:
    """The engine runs in a process of its own unless ``SPECDECODE_ENGINE_PROCESS=0`` keeps it in
    the front end's (the reference for measuring what the split buys, and for debugging)."""
    return os.environ.get("SPECDECODE_ENGINE_PROCESS", "1") != "0"


@dataclass(frozen=True)
class Limits:
    """What the front end checks a request against before it crosses the pipe."""

    context_len: int
    pool_tokens: int
    slots_per_round: int
    vocab_size: int


# ---- the front end's side ---------------------------------------------------------------------------
class EngineProcess:
    """An ``EngineService`` whose engine runs in a child process (see the module docstring)."""

    def __init__(self, args: EngineArgs, eos_token_ids: frozenset[int] = frozenset(),
                 on_crash: Callable[[str], None] | None = None):
        self.args = args
        self.eos_token_ids = eos_token_ids
        self.on_crash = on_crash  # called once, from the reader thread, if the engine process dies serving
        self.ready = False
        self.limits: Limits | None = None
        self.failure: str | None = None  # why the engine process is gone, once it is
        self.process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the open requests against the reader's crash handling
        self._requests: dict[int, Request] = {}
        self._questions = itertools.count()
        self._answers: dict[int, list] = {}  # question -> [Event, report]
        self._started = threading.Event()
        self._startup_error: Exception | None = None
        self._stopping = False
        self._last_report = EngineReport(ready=False, phase=Phase.CREATED.name, stats=Stats())

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size if self.limits else 0

    # ---- start and stop -------------------------------------------------------------------------
    def start_up(self) -> None:
        """Start the engine process and wait until it is ready, or raise its start-up error."""
        context = multiprocessing.get_context("spawn")  # not fork: the front end has threads
        ours, theirs = context.Pipe()
        level = logging.getLogger().getEffectiveLevel()
        self.process = context.Process(target=engine_main, name="specdecode-engine",
                                       args=(theirs, self.args, self.eos_token_ids, level))
        self.process.start()
        theirs.close()
        self._conn = ours
        log.info("engine process %d started", self.process.pid)
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()
        self._started.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self) -> None:
        self._stopping = True
        if self.process is None:
            return
        self._send(STOP)
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("the engine process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
            self.process.kill()
            self.process.join()

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        if not self.ready:
            raise PhaseError(self.failure or "the engine is still initialising")
        limits = self.limits
        check_request(req, limits.context_len, limits.pool_tokens, limits.slots_per_round, limits.vocab_size)
        with self._lock:
            if self.failure:
                raise PhaseError(self.failure)
            self._requests[req.rid] = req
        grammar = req.grammar.source if req.grammar is not None else None
        self._send(SUBMIT, req.rid, req.prompt_ids, req.params, {f: getattr(req, f) for f in OPTIONS}, grammar)
        return req

    def abort(self, req: Request) -> None:
        req.abort_requested = True
        self._send(ABORT, req.rid)

    def report(self) -> EngineReport:
        """The engine's report now. While it starts (it sends one at each phase) or once it is
        stopping or gone, the last one it gave: a question then could wait on its start-up."""
        if not self.ready or self._stopping:
            return self._last_report
        question = next(self._questions)
        answer = self._answers[question] = [threading.Event(), None]
        self._send(REPORT, question)
        if answer[0].wait(REPORT_TIMEOUT_S) and answer[1] is not None:
            self._last_report = answer[1]
        self._answers.pop(question, None)
        return self._last_report

    # ---- the wire --------------------------------------------------------------------------------
    def _send(self, *message) -> None:
        if self._conn is None:  # not started: nothing to tell
            return
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the engine process is gone: the reader fails what was open
            pass

    def _read(self) -> None:
        """The reader thread: every message from the engine process, until its pipe closes."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == UPDATES:
                for entry in message[1]:
                    if entry[0] == TOKENS:
                        self._tokens(*entry[1:])
                    else:
                        self._end(*entry[1:])
            elif kind == REPORT:
                if message[1] is None:  # a start-up phase finished
                    self._last_report = message[2]
                answer = self._answers.get(message[1])
                if answer is not None:
                    answer[1] = message[2]
                    answer[0].set()
            elif kind == STARTED:
                self.limits = message[1]
                self.ready = True
                self._started.set()
            elif kind == FAILED:
                self._startup_error = _ERRORS.get(message[1], RuntimeError)(message[2])
                self._started.set()
        self._gone()

    def _tokens(self, rid: int, tokens: list[int], logprobs: list, prompt_logprobs: list) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        req.prompt_token_logprobs.extend(TokenLogprob(*p) for p in prompt_logprobs)
        req.output_logprobs.extend(TokenLogprob(*p) for p in logprobs)
        req.output_ids.extend(tokens)
        if req.on_update:
            req.on_update(req, tokens)

    def _end(self, rid: int, finish_reason: str | None, error: str | None, counters: dict,
             prompt_logprobs: list) -> None:
        with self._lock:
            req = self._requests.pop(rid, None)
        if req is None:
            return
        req.prompt_token_logprobs.extend(TokenLogprob(*p) for p in prompt_logprobs)
        for name, value in counters.items():
            setattr(req, name, value)
        req.finish_reason, req.error = finish_reason, error
        _tell_done(req)

    def _gone(self) -> None:
        """The engine process's pipe closed: asked to stop, or it died."""
        self.process.join(5)
        why = f"the engine process exited (exit code {self.process.exitcode})"
        crashed = self._started.is_set() and not self._stopping
        if crashed:  # first, so that what fails below answers 503
            log.error("%s while serving", why)
            if self.on_crash:
                self.on_crash(why)
        with self._lock:
            self.failure = why
            self.ready = False
            open_requests, self._requests = list(self._requests.values()), {}
        for req in open_requests:
            req.error = why
            _tell_done(req)
        for answer in list(self._answers.values()):
            answer[0].set()
        if not self._started.is_set():
            self._startup_error = RuntimeError(why)
            self._started.set()


def _tell_done(req: Request) -> None:
    if req.on_update:
        req.on_update(req, None)
    req.done.set()


# ---- the engine process's side ----------------------------------------------------------------------
def engine_main(conn, args: EngineArgs, eos_token_ids: frozenset[int], log_level: int) -> None:
    """The engine process: start the engine, then serve the front end's messages until ``stop`` or
    until the front end is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end drains on these, then sends stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .cpu_threads import use_cpus

    use_cpus(args.device)
    _EngineSide(conn, args, eos_token_ids).run()


class _EngineSide:
    """The engine process's end of the pipe: requests in, tokens and reports out."""

    def __init__(self, conn, args: EngineArgs, eos_token_ids: frozenset[int]):
        from ..engine.engine import Engine, LoopHooks
        from .cpu_threads import follow_load

        self.conn = conn
        self.engine = Engine(args, eos_token_ids=eos_token_ids,
                             hooks=LoopHooks(before_step=follow_load(args.device), after_step=self.flush))
        self.send_lock = threading.Lock()  # the engine's loop and this process's main thread both send
        self.requests: dict[int, Request] = {}
        self.sent: dict[int, tuple[int, int]] = {}  # per request: output and prompt logprobs already sent
        self.pending: list[tuple] = []  # this step's updates, sent together after it
        self.pending_lock = threading.Lock()
        self.tokenizer: Any = None  # loaded for the first grammar

    def run(self) -> None:
        threading.Thread(target=self._start_up, name="engine-init", daemon=True).start()
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the front end is gone
                break
            kind = message[0]
            if kind == SUBMIT:
                self._submit(*message[1:])
            elif kind == ABORT:
                req = self.requests.get(message[1])
                if req is not None:
                    self.engine.abort(req)
            elif kind == REPORT:
                self._send(REPORT, message[1], self.engine.report())
            elif kind == STOP:
                break
        self.engine.stop()

    def _start_up(self) -> None:
        engine = self.engine
        started = threading.Event()
        threading.Thread(target=self._tell_phases, args=(started,), name="engine-phases", daemon=True).start()
        try:
            engine.start_up()
        except Exception as exc:
            if not isinstance(exc, (StartupError, InputError)):
                log.exception("engine start-up failed")
            self._send(FAILED, type(exc).__name__, " ".join(str(exc).split()) or type(exc).__name__)
            return
        finally:
            started.set()
        limits = Limits(engine.args.context_len, engine.memory_pool_config.max_total_num_tokens,
                        engine.speculator.slots_per_round, engine.vocab_size)
        self._send(STARTED, limits)

    def _tell_phases(self, started: threading.Event) -> None:
        """A report at each start-up phase, unasked: the front end's /health shows it."""
        told = None
        while True:
            finished = started.is_set()
            if self.engine.phase != told:
                told = self.engine.phase
                self._send(REPORT, None, self.engine.report())
            if finished:
                return
            started.wait(0.1)

    def _send(self, *message) -> None:
        with self.send_lock:
            self.conn.send(message)

    def _submit(self, rid: int, prompt_ids: list[int], params, options: dict, grammar: str | None) -> None:
        req = Request(prompt_ids, params, rid=rid, on_update=self._on_update, **options)
        self.requests[rid] = req
        try:
            req.grammar = self._grammar(grammar) if grammar is not None else None
            self.engine.submit(req)
        except Exception as exc:  # the front end checked it: this is a mismatch between the two
            log.exception("request %d refused by the engine", rid)
            req.error = f"internal error: {type(exc).__name__}: {exc}"
            self._on_update(req, None)
            self.flush()

    def _grammar(self, source: str):
        from .structured import token_grammar
        from .tokenizer import load_tokenizer

        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.engine.args.target)
        return token_grammar(self.tokenizer, self.engine.vocab_size, source)

    def _on_update(self, req: Request, tokens: list[int] | None) -> None:
        """From the engine's loop: the tokens the scheduler committed, or the request's end. Logprobs
        cross as plain tuples: a dataclass pickles several times slower."""
        outputs, prompts = self.sent.get(req.rid, (0, 0))
        prompt = [_plain(p) for p in req.prompt_token_logprobs[prompts:]]
        if tokens is None:
            self.requests.pop(req.rid, None)
            self.sent.pop(req.rid, None)
            entry = (END, req.rid, req.finish_reason, req.error, {f: getattr(req, f) for f in COUNTERS}, prompt)
        else:
            self.sent[req.rid] = (len(req.output_logprobs), len(req.prompt_token_logprobs))
            entry = (TOKENS, req.rid, tokens, [_plain(p) for p in req.output_logprobs[outputs:]], prompt)
        with self.pending_lock:
            self.pending.append(entry)

    def flush(self) -> None:
        """Send the updates gathered since the last flush, in one message."""
        with self.pending_lock:
            updates, self.pending = self.pending, []
        if updates:
            self._send(UPDATES, updates)


def _plain(entry: TokenLogprob) -> tuple:
    return entry.token, entry.logprob, entry.top
