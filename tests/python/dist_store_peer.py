"""The other side of titan's TCPStore interop test, using torch.distributed's own TCPStore.

usage: dist_store_peer.py server            host a store on a free port, print the port, then
                                            exchange keys with titan's client
       dist_store_peer.py client PORT       connect to titan's store as a client and exchange keys
Exits 0 when every value matched, 1 with a message otherwise.
"""
import sys
from datetime import timedelta

from torch.distributed import TCPStore


def exchange(store, me, peer):
    # titan writes first; torch checks, answers, and both sides see the shared counter.
    got = store.get(f"{peer}/hello")
    if got != b"hello from titan \x00\xff":
        raise SystemExit(f"{me}: wrong value for {peer}/hello: {got!r}")
    store.set(f"{me}/reply", "hello from torch")
    n = store.add("shared/counter", 5)
    store.set(f"{me}/counter_after_add", str(n))
    # Wait until titan says it is done, so the server outlives titan's last request.
    store.wait([f"{peer}/done"], timedelta(seconds=30))


def main():
    role = sys.argv[1]
    if role == "server":
        store = TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                         timeout=timedelta(seconds=30), wait_for_workers=False)
        print(store.port, flush=True)
        exchange(store, "torch", "titan")
    else:
        store = TCPStore("127.0.0.1", int(sys.argv[2]), is_master=False,
                         timeout=timedelta(seconds=30))
        exchange(store, "torch", "titan")
    print("ok", flush=True)


if __name__ == "__main__":
    main()
