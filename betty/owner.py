"""Folders named after the process that owns them, and reclaiming those whose owner is gone.

A process removes its temporary folders (a launcher's shared dataset,
:func:`betty.distributed.shared.share_dataset`; a cache entry being written,
:class:`betty.data.store.StoreWriter`) on every exit it can catch; SIGKILL it cannot. So
the folder's name says who owns it, and the next process to make one removes the folders
whose owner no longer runs:

    betty-<pid>-<start>-<pidns>-<boot>-<random>     (or .<label>.betty-...: a hidden one)

* ``pid``: the owner's process ID;
* ``start``: the owner's start time, in clock ticks after boot (field 22 of
  ``/proc/<pid>/stat``): a process now holding the same pid but started at another time
  is not the owner (pid reuse); an owner that is a zombie (exited, not yet reaped) is gone;
* ``pidns``: the inode of the owner's PID namespace (``/proc/self/ns/pid``): pids of
  another namespace (another container sharing ``/dev/shm``) mean nothing here, so such
  folders are never judged;
* ``boot``: the first 8 hex digits of ``/proc/sys/kernel/random/boot_id``: a folder from
  an earlier boot (the temp-dir fallback survives reboots) has no live owner, unless the
  folder may lie on a disk other machines share (``this_boot_only``: then only owners of
  this boot are judged).

``0`` stands for a value the system does not report (then only ``os.kill(pid, 0)`` tells
whether the pid exists). Folders of another user, of another format (those of older
versions included) or of a live owner are left alone.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

__all__ = ["Owner", "pid_exists", "reclaim_stale_folders"]

_NAME = re.compile(r"^(?:\..*\.)?betty-(\d+)-(\d+)-(\d+)-([0-9a-f]{8}|0)-[^-]+$")


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, start)`` of process ``pid``: its state letter (``"Z"``: a zombie, which
    has exited) and its start time in clock ticks after boot; ``None`` when
    ``/proc/<pid>/stat`` cannot be read (no such process, or no ``/proc``)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the fields resume
    # after the last ")", the first of them (state) being field 3, starttime field 22.
    rest = stat[stat.rindex(")") + 2:].split()
    return rest[0], int(rest[22 - 3])


def _pid_namespace() -> int:
    try:
        return int(re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or 0)
    except OSError:
        return 0


def _boot_id() -> str:
    boot = _read("/proc/sys/kernel/random/boot_id")
    return boot.strip().replace("-", "")[:8] if boot else "0"


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists in this PID namespace (signal 0; one of another
    user counts, a zombie too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _has_proc() -> bool:
    return os.path.isdir(f"/proc/{os.getpid()}")


@dataclass(frozen=True)
class Owner:
    """Who owns a folder: ``pid``, ``start`` (clock ticks after boot), ``pidns`` (PID
    namespace inode), ``boot`` (8 hex digits of the boot ID); ``0`` where unknown."""

    pid: int
    start: int
    pidns: int
    boot: str

    @classmethod
    def current(cls) -> "Owner":
        """This process."""
        return cls.of_process(os.getpid())

    @classmethod
    def of_process(cls, pid: int) -> "Owner":
        """Process ``pid`` of this PID namespace, now (start ``0`` if it does not exist)."""
        stat = _stat(pid)
        return cls(pid, stat[1] if stat else 0, _pid_namespace(), _boot_id())

    @classmethod
    def of(cls, name: str) -> "Owner | None":
        """The owner a folder name states, ``None`` for a name of another format."""
        m = _NAME.match(name)
        return None if m is None else cls(int(m[1]), int(m[2]), int(m[3]), m[4])

    def prefix(self, label: str | None = None) -> str:
        """``betty-<pid>-<start>-<pidns>-<boot>-``: the start of a folder name (a unique
        suffix follows, e.g. from ``tempfile.mkdtemp``); with ``label``, a hidden name
        that says what the folder is for: ``.<label>.betty-...-``."""
        name = f"betty-{self.pid}-{self.start}-{self.pidns}-{self.boot}-"
        return name if label is None else f".{label}.{name}"

    def is_gone(self, here: "Owner | None" = None) -> bool:
        """Whether this owner surely no longer runs, judged from process ``here``
        (default: this one). ``False`` where that cannot be told (another PID namespace)."""
        here = here or Owner.current()
        if "0" not in (self.boot, here.boot) and self.boot != here.boot:
            return True  # an earlier boot
        if self.pidns != here.pidns:
            return False  # its pids are not ours to look up
        if _has_proc():
            stat = _stat(self.pid)
            return stat is None or stat[0] == "Z" or (self.start != 0 and stat[1] != self.start)
        return not pid_exists(self.pid)


def reclaim_stale_folders(parent: str, *, this_boot_only: bool = False) -> list[str]:
    """Remove the folders of ``parent`` named ``betty-<owner>-...`` or
    ``.<label>.betty-<owner>-...`` (:meth:`Owner.prefix`) that belong to this user and
    whose owner is gone; return their paths. Files of a removed folder that a process
    still maps stay valid until it unmaps them. ``this_boot_only``: judge only the
    owners of this machine's current boot (for a folder other machines may share: their
    boots are not ours, their pids not ours to look up)."""
    here = Owner.current()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        owner = Owner.of(entry.name)
        if owner is None or not entry.is_dir(follow_symlinks=False):
            continue
        if this_boot_only and (owner.boot != here.boot or here.boot == "0"):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if owner.is_gone(here):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.lexists(entry.path):
                removed.append(entry.path)
    return removed
