"""The matmul loop of `orbitkv-perf dma --interference` (perf/src/dma/matmul_loop.rs runs it
as `python3 -c`, embedded at build time): two 8192 x 8192 bf16 matrices on the GPU given as the
first argument, four products per line of output (`<perf_counter seconds> <products so far>`),
after a `ready` line. With four more arguments (page bytes, staging batch bytes, pool bytes,
batches in flight) it also runs the engine-side copies on command (lines on stdin)."""
import queue, sys, time, threading
import torch
_out = threading.Lock()
def say(line):
    # One write per line, under a lock: the loop and the copier thread both report, and
    # print() writes a line's text and its newline separately, so two threads' lines could
    # interleave into one that neither reader understands.
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
dev = int(sys.argv[1])
torch.cuda.set_device(dev)
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
if len(sys.argv) > 4:
    page, batch, pool_bytes, depth = (int(x) for x in sys.argv[2:6])
    pages = pool_bytes // page
    per = max(1, min(batch // page, pages))
    pool = torch.randn(pages, page // 2, device="cuda", dtype=torch.bfloat16)
    # The pages moved as 8-byte words where they divide: index_select and index_copy_ copy one
    # element per thread, so bf16 elements hold the SMs four times as long per byte beside the
    # engine's own kernels.
    word = torch.int64 if page % 8 == 0 else torch.bfloat16
    pool = pool.view(word)
    elems = pool.shape[1]
    host = torch.empty(pages, elems, dtype=word, pin_memory=True)
    order = torch.randperm(pages, device="cuda")
    idx = [order[i:i + per] for i in range(0, pages - per + 1, per)]
    # `depth` staging batches in flight (4 by default): with two, each batch's kernel waited for
    # SMs behind the matmul's and the copy engine idled meanwhile (2 KiB pages beside the
    # matmul on an H200: saves 42 GB/s with two, 55 with four).
    # One tensor, so that a server can copy from it too (ops save-server and load-server):
    # its CUDA IPC handle goes out before `ready`.
    stage_all = torch.empty(depth * per, elems, device="cuda", dtype=word)
    staging = [stage_all[i * per:(i + 1) * per] for i in range(depth)]
    try:
        shared = stage_all.untyped_storage()._share_cuda_()
        size = stage_all.numel() * stage_all.element_size()
        handle = bytes(shared[1])
        # PyTorch 2 puts a version (2) and a kind before the 64-byte cudaIpcMemHandle_t:
        # 'c' for a cudaMalloc'd block; an expandable segment's ('e') is no such handle.
        if len(handle) == 66 and handle[0] == 2 and handle[1:2] == b"c":
            handle = handle[2:]
        if len(handle) != 64:
            raise ValueError(f"an IPC handle of {len(handle)} bytes, kind {handle[1:2]!r}")
        say(f"staging {handle.hex()} {int(shared[3])} {size}")
    except Exception as e:
        say(f"staging-unshared {type(e).__name__}: {e}")
    gather_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    filled = [torch.cuda.Event() for _ in range(depth)]
    free = [torch.cuda.Event() for _ in range(depth)]
    state = {"op": "idle"}
    # Served ops: set when the slot is this process's again ("free J": the server has copied
    # it out) or holds a loaded batch ("loaded J K").
    handed = [threading.Event() for _ in range(depth)]
    loaded = [0] * depth

    def commands():
        for line in sys.stdin:
            w = line.split()
            if len(w) == 2 and w[0] == "free":
                handed[int(w[1])].set()
            elif len(w) == 3 and w[0] == "loaded":
                loaded[int(w[1])] = int(w[2])
                handed[int(w[1])].set()
            elif w:
                state["op"] = w[0]

    def take(j, op):
        while not handed[j].wait(0.005):
            if state["op"] != op:
                return False
        handed[j].clear()
        return True

    def served(op):
        # save-server: each gathered batch goes out as "staged J K"; perf has the server save
        # slot J and answers "free J". load-server: perf has the server load a batch K into
        # slot J ("loaded J K"); it is scattered, and "scattered J" hands the slot back.
        # Every slot's kernel is queued as soon as the slot is ours, and a second thread says
        # each done in turn: waiting for one kernel before queueing the next held the
        # batches to one at a time, each behind the matmul's blocks for SMs.
        done = queue.Queue()

        def report():
            while (item := done.get()) is not None:
                j, line = item
                filled[j].synchronize()
                say(line)

        reporter = threading.Thread(target=report, daemon=True)
        reporter.start()
        step = 0
        while state["op"] == op:
            j, k = step % depth, step % len(idx)
            if op == "save-server":
                if step >= depth and not take(j, op):
                    break
                with torch.cuda.stream(gather_stream):
                    torch.index_select(pool, 0, idx[k], out=staging[j])
                    filled[j].record(gather_stream)
                done.put((j, f"staged {j} {k}"))
            else:
                if not take(j, op):
                    break
                with torch.cuda.stream(gather_stream):
                    pool.index_copy_(0, idx[loaded[j] % len(idx)], staging[j])
                    filled[j].record(gather_stream)
                done.put((j, f"scattered {j}"))
            step += 1
        done.put(None)
        reporter.join()
        for e in handed:
            e.clear()

    def copier():
        torch.cuda.set_device(dev)
        op, moved, step = "idle", 0, 0
        while True:
            if state["op"] != op:
                torch.cuda.synchronize()
                op, moved, step = state["op"], 0, 0
            if op in ("save-server", "load-server"):
                served(op)
                continue
            if op not in ("save", "load"):
                time.sleep(0.001)
                continue
            j, k = step % depth, step % len(idx)
            if step >= depth:
                # The batch `depth` steps back has landed: its staging batch is free again.
                free[j].synchronize()
                moved += per * page
                say(f"copy {op} {time.perf_counter():.6f} {moved}")
            rows = host[k * per:(k + 1) * per]
            if op == "save":
                with torch.cuda.stream(gather_stream):
                    gather_stream.wait_event(free[j])
                    torch.index_select(pool, 0, idx[k], out=staging[j])
                    filled[j].record(gather_stream)
                with torch.cuda.stream(copy_stream):
                    copy_stream.wait_event(filled[j])
                    rows.copy_(staging[j], non_blocking=True)
                    free[j].record(copy_stream)
            else:
                with torch.cuda.stream(copy_stream):
                    copy_stream.wait_event(free[j])
                    staging[j].copy_(rows, non_blocking=True)
                    filled[j].record(copy_stream)
                with torch.cuda.stream(gather_stream):
                    gather_stream.wait_event(filled[j])
                    pool.index_copy_(0, idx[k], staging[j])
                    free[j].record(gather_stream)
            step += 1

    threading.Thread(target=commands, daemon=True).start()
    threading.Thread(target=copier, daemon=True).start()
for _ in range(3):
    c = a @ b
torch.cuda.synchronize()
say("ready")
count = 0
main = torch.cuda.current_stream()
while True:
    for _ in range(4):
        c = a @ b
    # This stream only: a device-wide sync would also wait for the engine-side copies.
    main.synchronize()
    count += 4
    say(f"{time.perf_counter():.6f} {count}")
