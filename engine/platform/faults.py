"""Faults that stay with their request. blame() tells which requests a failed batch
operation failed for, by trying each alone. Fault injection, for tests, makes the
engine raise for chosen requests at a named point, to show it.

Points: "prepare" (building the step's batch), "sample" (before the step's tokens are
drawn) and "decode" (reading the drawn tokens and logprobs on the host). Each is a
method marked @fault_point: disarmed, the normal state, its class holds the plain
method and the point costs nothing; while a fault is armed there, the class holds
a wrapper that trips first. Faults live in this process: a test arms them around an
in-process engine (thread mode); an engine process has its own, disarmed, registry."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvserve.scheduler.request import Request

log = logging.getLogger("kvserve.engine")

POINTS = ("prepare", "sample", "decode")

class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    where: str
    match: Callable[[Request], bool]
    message: str


# Replaced, never mutated: the engine thread iterates a snapshot without a lock.
_faults: tuple[Fault, ...] = ()


@dataclass(frozen=True)
class _Site:
    where: str
    owner: type
    name: str
    method: Callable
    requests_of: Callable[..., Iterable[Request]]  # the method's (self, *args, **kw)


_sites: list[_Site] = []


class _Point:
    def __init__(self, where: str, requests_of, method: Callable):
        self.where, self.requests_of, self.method = where, requests_of, method

    def __set_name__(self, owner: type, name: str) -> None:
        _sites.append(_Site(self.where, owner, name, self.method, self.requests_of))
        setattr(owner, name, self.method)  # the plain method until a fault is armed


def fault_point(where: str, requests_of: Callable[..., Iterable[Request]]):
    """Marks a method as the fault point `where`; requests_of(self, *args, **kw)
    says which requests a call is for."""
    if where not in POINTS:
        raise ValueError(f"unknown fault point {where!r}; one of {POINTS}")
    return lambda method: _Point(where, requests_of, method)


def _tripping(site: _Site) -> Callable:
    method, requests_of, where = site.method, site.requests_of, site.where

    def tripped(*args, **kwargs):
        trip(where, requests_of(*args, **kwargs))
        return method(*args, **kwargs)
    return tripped


def _install() -> None:
    armed_at = {f.where for f in _faults}
    for site in _sites:
        setattr(site.owner, site.name,
                _tripping(site) if site.where in armed_at else site.method)


def arm(match: Callable[[Request], bool], where: str = "sample",
        message: str = "injected fault") -> Fault:
    """From now on, `where` raises InjectedFault(message) for a request `match` accepts."""
    global _faults
    if where not in POINTS:
        raise ValueError(f"unknown fault point {where!r}; one of {POINTS}")
    fault = Fault(where, match, message)
    _faults = (*_faults, fault)
    _install()
    return fault


def disarm(fault: Fault | None = None) -> None:
    """Removes `fault`, or every fault."""
    global _faults
    _faults = tuple(f for f in _faults if fault is not None and f is not fault)
    _install()


@contextlib.contextmanager
def armed(match: Callable[[Request], bool], where: str = "sample",
          message: str = "injected fault") -> Iterator[Fault]:
    fault = arm(match, where, message)
    try:
        yield fault
    finally:
        disarm(fault)


def trip(where: str, requests: Iterable[Request]) -> None:
    """Raises InjectedFault for the first of `requests` a fault armed at `where`
    matches."""
    faults = [f for f in _faults if f.where == where]
    for req in requests:
        for f in faults:
            if f.match(req):
                raise InjectedFault(f"{f.message} (request {req.request_id})")


def blame(exc: Exception, owners: Iterable[str], alone: Callable[[str], object],
          stage: str) -> dict[str, str]:
    """After `stage` raised `exc` for a batch: {owner: why} for each owner for whom
    `alone(owner)` raises too. Re-raises `exc` when that is nobody, or every one of
    several (a broken engine, not a broken request): the engine loop then dies."""
    owners = list(dict.fromkeys(owners))
    failed = {}
    for owner in owners:
        try:
            alone(owner)
        except Exception as own:  # noqa: BLE001 - this request's own fault
            log.warning("request %s failed in %s", owner, stage, exc_info=own)
            failed[owner] = f"{type(own).__name__}: {own}"
    if not failed or (len(owners) > 1 and len(failed) == len(owners)):
        raise exc
    return failed


def prompt_is(prompt_token_ids: Sequence[int]) -> Callable[[Request], bool]:
    """A predicate: the request (any of its n sequences) has exactly this prompt."""
    prompt = list(prompt_token_ids)
    return lambda req: (req.num_prompt_tokens == len(prompt)
                        and req.token_ids[:len(prompt)] == prompt)
