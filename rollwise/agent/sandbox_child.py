"""The sandbox's child process (run as a script by `rollwise.agent.sandbox`, never imported): it applies
the resource limits and, unless told otherwise, leaves the network namespace, reports what it got on
the status pipe, then runs the program as `__main__` in its working directory (or becomes `/bin/sh -c`
for a shell command). Its own frame is cut from tracebacks, so the model sees its program's error
alone. Standard library only: it starts fast."""
import ctypes
import json
import os
import resource
import sys
import time
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def leave_network() -> bool:
    """A network namespace of our own holds only a loopback that is down: no connection leaves it.
    Root can make one; others can in a user namespace of their own, where the kernel allows it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    return any(libc.unshare(flags) == 0 for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET))


def joined(name: str, count: int, timeout_s: float = 2.0) -> bool:
    """Wait until the sandbox has moved this process into the run's `count` cgroups called `name`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open("/proc/self/cgroup") as f:
            if f.read().count(f"/{name}\n") >= count:
                return True
        time.sleep(0.0005)
    return False


def main() -> None:
    lim = json.loads(sys.argv[1])
    status_fd = int(sys.argv[2])
    bounded = "cgroup" in lim and joined(*lim["cgroup"])  # (rollwise.agent.cgroups) before anything forks
    isolated = lim["network"] != "allow" and leave_network()
    os.write(status_fd, json.dumps({"network_isolated": isolated, "bounded": bounded}).encode())
    os.close(status_fd)
    if lim["network"] == "deny" and not isolated:
        print("sandbox: network isolation is unavailable on this machine (network='deny')", file=sys.stderr)
        sys.exit(125)
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_mb"] * mb, lim["file_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
    if "shell" in lim:
        os.execv("/bin/sh", ["sh", "-c", lim["shell"]])
    sys.dont_write_bytecode = True
    sys.argv = ["main.py"]
    sys.path[:0] = [os.getcwd()]
    sys.path.extend(p for p in lim.get("path", []) if p not in sys.path)  # (started without `site`)
    with open(lim["program"], encoding="utf-8") as f:
        source = f.read()
    scope = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), scope)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the program's error, shown as Python would show it
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
