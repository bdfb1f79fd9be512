"""The system-call filter of the sandbox (gateway/tools/sandbox.py): a classic BPF program
that bwrap loads (`--seccomp FD`) after it made the sandbox, just before it runs the command.

What it refuses (EPERM), after Docker's default profile, less what the sandbox already
cannot reach: the kernel's keyrings (`add_key`, `keyctl`, `request_key`: one user's keyring
is shared by every sandbox and outlives them), new namespaces and mounts (`unshare`, `setns`,
`clone` with a namespace flag, `mount` and the new mount API), kernel modules, kexec,
`bpf`, `perf_event_open`, `userfaultfd`, `io_uring`, reading another process's memory
(`process_vm_*`, `kcmp`, `pidfd_getfd`), file handles, swap, reboot, the clock, quotas,
`syslog`, NUMA policies, `personality` beyond the usual ones, and the `TIOCSTI`/`TIOCLINUX`
ioctls that push input into a terminal. `clone3` gets ENOSYS: its flags sit in memory a
filter cannot read, and every libc falls back to `clone`, whose flags it can.
`ptrace` stays: the sandbox's PID namespace holds its own processes alone, so a debugger
or strace reaches nothing else (Docker allows it too, on Linux 4.8 and later).

A call of another architecture (32-bit x86 on x86_64, x32, 32-bit ARM on aarch64) has other
numbers for the same calls: all of them fail with ENOSYS.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

# The kernel's ABI (linux/seccomp.h, linux/filter.h, linux/audit.h).
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
EPERM = 1
ENOSYS = 38
LD_ABS_W = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = the 32-bit word at offset k of seccomp_data
JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
RET = 0x06  # BPF_RET | BPF_K
NR_AT, ARCH_AT = 0, 4  # struct seccomp_data: int nr; __u32 arch; __u64 ip; __u64 args[6]


def arg_low(index: int) -> int:
    """Offset of the low 32 bits of argument `index` (the machines here are little-endian)."""
    return 16 + 8 * index


X32_SYSCALL_BIT = 0x40000000
# clone's namespace flags (linux/sched.h); CLONE_NEWTIME exists for clone3 and unshare alone.
CLONE_NAMESPACES = 0x7E020000
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
# personality(2) values Docker allows: Linux, Linux32, UNAME26 with either, and the query.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

REFUSED = (
    "add_key", "keyctl", "request_key",
    "unshare", "setns", "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr",
    "init_module", "finit_module", "delete_module", "create_module", "get_kernel_syms", "query_module",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "nfsservctl", "quotactl", "quotactl_fd",
    "bpf", "perf_event_open", "userfaultfd", "fanotify_init", "lookup_dcookie", "syslog", "vhangup",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise",
    "open_by_handle_at", "name_to_handle_at",
    "clock_settime", "settimeofday",
    "mbind", "set_mempolicy", "get_mempolicy", "move_pages", "set_mempolicy_home_node",
    "ioperm", "iopl", "uselib", "ustat", "sysfs", "_sysctl",
)
CHECKED = ("clone", "clone3", "personality", "ioctl")  # looked at more closely (or ENOSYS)

# The calls' numbers on each machine (arch/x86/entry/syscalls/syscall_64.tbl, and the
# generic table of include/uapi/asm-generic/unistd.h that aarch64 uses). A call a machine
# lacks is absent. tests/test_sandbox.py checks them against the system's headers.
_X86_64 = {
    "ioctl": 16, "clone": 56, "uselib": 134, "personality": 135, "ustat": 136, "sysfs": 139, "vhangup": 153,
    "pivot_root": 155, "_sysctl": 156, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173, "create_module": 174,
    "init_module": 175, "delete_module": 176, "get_kernel_syms": 177, "query_module": 178, "quotactl": 179,
    "nfsservctl": 180, "syslog": 103, "lookup_dcookie": 212, "clock_settime": 227, "mbind": 237,
    "set_mempolicy": 238, "get_mempolicy": 239, "kexec_load": 246, "add_key": 248, "request_key": 249,
    "keyctl": 250, "unshare": 272, "move_pages": 279, "perf_event_open": 298, "fanotify_init": 300,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "clone3": 435, "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442, "quotactl_fd": 443,
    "set_mempolicy_home_node": 450,
}
_GENERIC = {
    "lookup_dcookie": 18, "ioctl": 29, "umount2": 39, "mount": 40, "pivot_root": 41, "nfsservctl": 42,
    "vhangup": 58, "quotactl": 60, "acct": 89, "personality": 92, "unshare": 97, "kexec_load": 104,
    "init_module": 105, "delete_module": 106, "clock_settime": 112, "syslog": 116, "reboot": 142,
    "settimeofday": 170, "add_key": 217, "request_key": 218, "keyctl": 219, "clone": 220, "swapon": 224,
    "swapoff": 225, "mbind": 235, "get_mempolicy": 236, "set_mempolicy": 237, "move_pages": 239,
    "perf_event_open": 241, "fanotify_init": 262, "name_to_handle_at": 264, "open_by_handle_at": 265,
    "setns": 268, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "finit_module": 273,
    "bpf": 280, "userfaultfd": 282, "kexec_file_load": 294, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "clone3": 435, "pidfd_getfd": 438, "process_madvise": 440,
    "mount_setattr": 442, "quotactl_fd": 443, "set_mempolicy_home_node": 450,
}


@dataclass(frozen=True, slots=True)
class Machine:
    audit_arch: int  # AUDIT_ARCH_* of the native calls
    numbers: dict[str, int]
    x32: bool = False  # x86_64: calls with the x32 bit set come with the native arch value


MACHINES = {
    "x86_64": Machine(0xC000003E, _X86_64, x32=True),
    "aarch64": Machine(0xC00000B7, _GENERIC),
}


def machine() -> str:
    return os.uname().machine


def supported() -> str | None:
    """None, or why this machine gets no filter (and so no sandbox)."""
    if machine() not in MACHINES:
        return f"no system-call filter is known for this machine ({machine()}; x86_64 and aarch64 have one)"
    return None


class _Program:
    """A BPF program with forward jumps to labels, resolved when it is assembled."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int | str, int | str, int]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        self.code.append((code, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = bytearray()
        for at, (code, jt, jf, k) in enumerate(self.code):
            offsets = []
            for target in (jt, jf):
                offset = target if isinstance(target, int) else self.labels[target] - at - 1
                if not 0 <= offset <= 255:
                    raise ValueError(f"jump of {offset} at {at}: beyond a conditional jump's reach")
                offsets.append(offset)
            out += struct.pack("=HBBI", code, offsets[0], offsets[1], k)
        return bytes(out)


def program(name: str | None = None) -> bytes:
    """The filter for machine `name` (this one's by default), as `struct sock_filter`s."""
    spec = MACHINES[name or machine()]
    numbers = spec.numbers
    p = _Program()
    p.op(LD_ABS_W, ARCH_AT)
    p.op(JEQ, spec.audit_arch, 0, "enosys")
    p.op(LD_ABS_W, NR_AT)
    if spec.x32:
        p.op(JGE, X32_SYSCALL_BIT, "enosys", 0)
    for call in REFUSED:
        if call in numbers:
            p.op(JEQ, numbers[call], "refuse", 0)
    p.op(JEQ, numbers["clone3"], "enosys", 0)
    p.op(JEQ, numbers["clone"], "clone", 0)
    p.op(JEQ, numbers["personality"], "personality", 0)
    p.op(JEQ, numbers["ioctl"], "ioctl", 0)
    p.op(RET, RET_ALLOW)
    p.label("clone")  # the flags are its first argument on both machines
    p.op(LD_ABS_W, arg_low(0))
    p.op(JSET, CLONE_NAMESPACES, "refuse", 0)
    p.op(RET, RET_ALLOW)
    p.label("personality")
    p.op(LD_ABS_W, arg_low(0))
    for value in PERSONALITIES:
        p.op(JEQ, value, "allow", 0)
    p.op(RET, RET_ERRNO | EPERM)
    p.label("ioctl")  # the kernel reads the request as 32 bits: the high half does not matter
    p.op(LD_ABS_W, arg_low(1))
    p.op(JEQ, TIOCSTI, "refuse", 0)
    p.op(JEQ, TIOCLINUX, "refuse", 0)
    p.label("allow")
    p.op(RET, RET_ALLOW)
    p.label("refuse")
    p.op(RET, RET_ERRNO | EPERM)
    p.label("enosys")
    p.op(RET, RET_ERRNO | ENOSYS)
    return p.assemble()
