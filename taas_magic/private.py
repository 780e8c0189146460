"""Every private or undocumented API of another package that taas_magic calls, in one table.

Runs wherever it is imported, which is only tests/unit/test_private.py: no module of the package
imports it.

:data:`PRIVATE` names each one (a dotted path: a module, then attributes), the distribution
it comes from, the releases we have run it against, what we use it for and where. A line of
code that calls one says ``# private API: see taas_magic/private.py``.
tests/unit/test_private.py imports each one and checks its shape (it is there; it is
callable with the parameters we pass; it has the attributes we read, on the class or
assigned by the source that makes its instances; its source still calls the hook we
provide), and fails naming the API when a release changes it. It also scans the package for
``obj._name`` and ``from x._y import`` and fails on any that this table does not name (an
underscored name the package defines itself is its own), so the table cannot fall behind
the code. .ci/run runs it on the newest releases and on the declared minimums
(.ci/minimums.txt).

``since``: the first release of the package that has it; on an older one taas_magic does
without it (``use`` says how) and the test is skipped there.

Only the public APIs of Optuna, Lightning, jupyter_client and comm are used: none is here.
This module imports nothing: it is read by the test, and by people.
"""

from __future__ import annotations

from dataclasses import dataclass

# The releases each package's entries were run against: the declared minimum, the newest we tested.
IPYKERNEL = "6.19.1, 6.20.1, 7.3.0, 7.4.0"
IPYKERNEL_7 = "7.3.0, 7.4.0"  # ipykernel 7's shell-channel thread: 6.x has none of it (see each since)
IPYTHON = "8.10.0, 9.18.1"
CLOUDPICKLE = "2.1.0, 2.2.0, 3.1.3"
ANYWIDGET = "0.9.0, 0.11.0"
IPYWIDGETS = "8.1.9"
TORCH = "2.13.0 (the CPU build: the CUDA IPC calls' results only by tests/gpu, on a GPU host)"
RAY = "2.60.0"
ACCELERATE = "1.15.0"
TRANSFORMERS = "5.24.0"
PYTHON = "3.10.13, 3.11.7"


@dataclass(frozen=True)
class Private:
    """One private API (see the module docstring)."""

    name: str  # a module, then attributes: "torch.UntypedStorage._share_cuda_"
    package: str  # the distribution ("python": the standard library)
    checked: str  # the releases we have run it against
    use: str  # what taas_magic uses it for
    where: str  # the modules that use it (under taas_magic/)
    params: tuple[str, ...] = ()  # it is callable and takes parameters of these names
    attributes: tuple[str, ...] = ()  # it has these attributes (on the class, or set on each instance by its source)
    mentions: tuple[str, ...] = ()  # its source uses these names: a hook of ours it calls
    since: str = ""  # the package's first release that has it (see the module docstring)
    by_path: bool = False  # a class we recognise by module path and name: it must still be defined there
    set_in: tuple[str, ...] = ()  # modules (besides the class's own) whose source sets its instance attributes


_FRONTEND = "output/frontend.py"
_KERNEL = "ipykernel.kernelbase.Kernel"
_STORAGE = "torch.UntypedStorage"
_CUDA_IPC = "transfer/cudaipc.py"

PRIVATE: tuple[Private, ...] = (
    # -- ipykernel: JupyterLab's debugger panel on the ranks
    Private(f"{_KERNEL}._publish_debug_event", "ipykernel", IPYKERNEL,
            "the ranks' stopped / continued / thread events on IOPub as debug_event, as the kernel's debugger sends "
            "debugpy's", "debugger/panel.py", params=("event",)),
    # -- ipykernel: answering the page while a cell runs (ipykernel >= 7.4), addressing a detached run's display
    Private(f"{_KERNEL}.dispatch_shell", "ipykernel", IPYKERNEL_7,
            "dispatch a kernel_info_request at once (concurrent=True) while a cell holds the main shell; whether it "
            "takes `concurrent` is the probe for a kernel that answers the page mid-cell (frontend.answers_mid_cell)",
            _FRONTEND, params=("msg", "subshell_id", "concurrent"), since="7.4"),
    Private(f"{_KERNEL}.shell_main", "ipykernel", IPYKERNEL_7,
            "the main shell's message handler, wrapped to answer kernel_info_request while a cell runs", _FRONTEND,
            params=("subshell_id", "msg"), since="7.0"),
    Private(f"{_KERNEL}._main_asyncio_lock", "ipykernel", IPYKERNEL_7,
            "held while a cell runs on the main shell: whether a kernel_info_request must be let through", _FRONTEND,
            since="7.0"),
    Private(f"{_KERNEL}._shell_parent_ident", "ipykernel", IPYKERNEL_7,
            "the running cell's identity, restored after the kernel_info reply", _FRONTEND, since="7.0"),
    Private(f"{_KERNEL}._get_shell_context_var", "ipykernel", IPYKERNEL_7,
            "reads _shell_parent_ident as the main shell sees it", _FRONTEND, params=("var",), since="7.1"),
    Private(f"{_KERNEL}.shell_channel_thread", "ipykernel", IPYKERNEL_7,
            "its .manager (SubshellManager), where the wrapped handler is registered on a started kernel", _FRONTEND,
            since="7.0"),
    Private("ipykernel.subshell_manager.SubshellManager.set_on_recv_callback", "ipykernel", IPYKERNEL_7,
            "registers the wrapped main-shell handler on a kernel that has started already", _FRONTEND,
            params=("on_recv_callback",), since="7.0"),
    Private(f"{_KERNEL}._publish_status", "ipykernel", IPYKERNEL,
            "'idle' for the kernel_info reply, then 'busy' again for the running cell", _FRONTEND,
            params=("status", "channel", "parent")),
    Private(f"{_KERNEL}.set_parent", "ipykernel", IPYKERNEL,
            "the running cell's parent header restored after the kernel_info reply", _FRONTEND,
            params=("ident", "parent", "channel")),
    Private(f"{_KERNEL}.get_parent", "ipykernel", IPYKERNEL,
            "the running cell's request: its parent header, and whether a notebook page sent it (cellId)", _FRONTEND,
            params=("channel",)),
    Private("ipykernel.comm.comm.Comm._reply_subshell_for", "ipykernel", IPYKERNEL_7,
            "wrapped on the widget probe's comm so its answer is heard on the shell-channel thread while cells "
            "run; without it the answer is heard between cells", _FRONTEND, params=("data", "default"), since="7.4"),
    Private(f"{_KERNEL}.shell_channel_thread_main", "ipykernel", IPYKERNEL_7,
            "calls a comm's _reply_subshell_for: how the probe's wrapper is reached", _FRONTEND,
            mentions=("_reply_subshell_for",), since="7.4"),
    Private("ipykernel.jsonutil.json_clean", "ipykernel", IPYKERNEL,
            "a detached run's display content made JSON-safe, as ipykernel's own publisher does", _FRONTEND,
            params=("obj",)),
    Private("ipykernel.zmqshell.ZMQDisplayPublisher", "ipykernel", IPYKERNEL,
            "a detached run's text view sends its displays through the publisher's session and socket, addressed "
            "to the cell that started the run (its parent header, captured then)", _FRONTEND,
            attributes=("session", "parent_header", "pub_socket", "topic")),
    # -- ipywidgets and anywidget: the live view's probe and the page's widget manager
    Private("ipywidgets.Widget.handle_control_comm_opened", "ipywidgets", IPYWIDGETS,
            "the jupyter.widget.control comm handed on to ipywidgets after noting that a page restores widgets",
            _FRONTEND, params=("comm", "msg")),
    Private("anywidget.AnyWidget", "anywidget", ANYWIDGET,
            "the probe model's state is built by hand (opening an AnyWidget imports ipywidgets): these traits' "
            "defaults are the names and module version it sends", _FRONTEND,
            attributes=("_model_name", "_model_module", "_model_module_version", "_view_name", "_view_module",
                        "_view_module_version")),
    Private("anywidget._util._ANYWIDGET_ID_KEY", "anywidget", ANYWIDGET, "the probe state's id key", _FRONTEND),
    Private("anywidget._util._ESM_KEY", "anywidget", ANYWIDGET, "the probe state's module key", _FRONTEND),
    # -- IPython
    Private("IPython.core.async_helpers._asyncio_runner", "ipython", IPYTHON,
            "whether the shell awaits cells on asyncio, so a taas cell can be one await (cell/transformer.py)",
            "__init__.py"),
    Private("IPython.core.compilerop.CachingCompiler._filename_map", "ipython", IPYTHON,
            "the notebook cells' file names and execution counts, shipped so a rank's traceback shows their lines",
            "cell/cellcode.py"),
    Private("IPython.core.interactiveshell.InteractiveShell.showtraceback", "ipython", IPYTHON,
            "shows an exception through its _render_traceback_ (our errors' one-line renderings)",
            "errors.py, kernel/runs/run.py, kernel/trials/searchrun.py", mentions=("_render_traceback_",)),
    Private("IPython.core.magic.MagicsManager", "ipython", IPYTHON,
            "unloading removes our magics from these tables (IPython has no API to unregister one), and puts "
            "IPython's %debug back", "__init__.py, kernel/magic/debug.py",
            attributes=("magics", "registry")),
    Private("IPython.core.displayhook.DisplayHook.semicolon_at_end_of_expression", "ipython", IPYTHON,
            "a cell ending in ';' shows no result, as IPython decides it", "cell/cellcode.py",
            params=("expression",)),
    # -- the standard library
    Private("linecache.cache", "python", PYTHON,
            "cell text registered and read as (size, mtime, lines, name) entries, as IPython's compiler does",
            "cell/cellcode.py, rank/execute.py"),
    Private("sys._current_frames", "python", PYTHON,
            "the rank's cell thread's innermost frame, looked at with its health every 2 s: how long it has waited "
            "in one call into torch.distributed (the hang line); the cell thread's frames, given the debugger panel's "
            "trace function for a new breakpoint or a pause", "autopsy/waiting.py, debugger/tracer.py"),
    Private("bdb.Bdb._set_stopinfo", "python", PYTHON,
            "the debugger panel's continue without bdb's set_continue, which removes the trace function when no "
            "breakpoint is left (a later pause or breakpoint would find none); its step for a pause from another "
            "thread", "debugger/tracer.py", params=("stopframe", "returnframe", "stoplineno")),
    Private("pickle._Unpickler", "python", PYTHON,
            "the pure-Python unpickler: its memo filled and its GET opcodes wrapped, to name the names whose "
            "shared objects could not be rebuilt", "transfer/unpack.py",
            attributes=("dispatch", "load_get", "load_binget", "load_long_binget", "stack", "memo")),
    # -- cloudpickle
    Private("cloudpickle.Pickler.dispatch_table", "cloudpickle", CLOUDPICKLE,
            "extended with our code-object reducer (notebook file names and line numbers kept)",
            "transfer/pickler.py"),
    Private("cloudpickle.Pickler.reducer_override", "cloudpickle", CLOUDPICKLE,
            "called after our own override (a wrapper pickled as its module)", "transfer/pack.py", params=("obj",)),
    # -- torch: CUDA IPC (the CUDA calls themselves need a GPU: tests/gpu/test_ipc.py)
    Private(f"{_STORAGE}._share_cuda_", "torch", TORCH,
            "a CUDA storage's IPC handle, the 8-item tuple torch/multiprocessing/reductions.py sends", _CUDA_IPC),
    Private(f"{_STORAGE}._new_shared_cuda", "torch", TORCH,
            "opens a handle's first 7 items (and False: its event is not waited on)", _CUDA_IPC),
    Private(f"{_STORAGE}._release_ipc_counter_cuda", "torch", TORCH,
            "gives back the exporter's share of the IPC ref count (items 4 and 5 of the handle)", _CUDA_IPC),
    Private(f"{_STORAGE}._cdata", "torch", TORCH, "a storage's identity: one blob per storage", "transfer/pack.py"),
    Private("torch.storage.TypedStorage._untyped_storage", "torch", TORCH,
            "the bytes under a pickled tensor's storage", "transfer/pack.py"),
    # -- torch: data loading as DataLoader does it, in the data workers
    Private("torch.utils.data._utils.worker._worker_info", "torch", TORCH,
            "set in a data worker so torch.utils.data.get_worker_info() answers as under DataLoader",
            "feed/extract.py"),
    Private("torch.utils.data._utils.worker.get_worker_info", "torch", TORCH,
            "returns _worker_info (what we set)", "feed/extract.py", mentions=("_worker_info",)),
    Private("torch.utils.data._utils.worker.WorkerInfo", "torch", TORCH,
            "what get_worker_info() returns in a data worker", "feed/extract.py, rank/identity.py",
            params=("id", "num_workers", "seed", "dataset")),
    Private("torch.utils.data.dataloader._DatasetKind.create_fetcher", "torch", TORCH,
            "a loader's own fetcher (its collate_fn and batching) for the elements a worker extracts",
            "feed/extract.py", params=("kind", "dataset", "auto_collation", "collate_fn", "drop_last")),
    Private("torch.utils.data.dataloader._DatasetKind", "torch", TORCH, "the kind passed to create_fetcher",
            "feed/extract.py", attributes=("Map", "Iterable")),
    Private("torch.utils.data.DataLoader._auto_collation", "torch", TORCH, "passed to create_fetcher",
            "feed/extract.py"),
    Private("torch.utils.data.DataLoader._index_sampler", "torch", TORCH,
            "the loader's order of indices (or of batches of them) for a pass", "feed/extract.py"),
    # -- torch: wrappers pickled as the module they wrap (recognised by module path and class name)
    Private("torch.nn.parallel.distributed.DistributedDataParallel", "torch", TORCH,
            "comes back as its .module", "transfer/unwrap.py", attributes=("module",), by_path=True),
    Private("torch.nn.parallel.data_parallel.DataParallel", "torch", TORCH, "comes back as its .module",
            "transfer/unwrap.py", attributes=("module",), by_path=True),
    # -- torch: each rank's time in collectives (the straggler line)
    Private("torch.nn.parallel.distributed.DistributedDataParallel", "torch", TORCH,
            "a model's Python communication hooks (its all-reduce is then timed by the dist.* calls they make; after "
            "heal rebuilt its reducer, its hook is registered again from the list); compiled autograd's reducer "
            "(not timed)", "output/ddptiming.py, rank/heal.py", attributes=("_comm_hooks", "_use_python_reducer")),
    Private("torch.nn.parallel.distributed.DistributedDataParallel._get_ddp_logging_data", "torch", TORCH,
            "DDP's own timer's latest sampled iteration (its events' times, its number), read on the cell's thread "
            "after a step: the straggler line's wait in DDP's all-reduce", "output/ddptiming.py"),
    Private("torch.nn.parallel.distributed.DistributedDataParallel._set_ddp_runtime_logging_sample_rate", "torch",
            TORCH, "which iteration DDP's timer samples next: at random up to about 0.1 s of a model's steps away, "
            "never rarer than DDP's default", "output/ddptiming.py", params=("sample_rate",)),
    Private("torch.nn.parallel.distributed.DistributedDataParallel._register_builtin_comm_hook", "torch", TORCH,
            "wrapped in kept ranks to note a built-in hook on the model by its name, registered again after heal "
            "rebuilt the model's reducer (on a rank heal copied the model to, too)", "rank/heal.py",
            params=("comm_hook_type",)),
    Private("torch.nn.parallel.distributed.DistributedDataParallel._match_all_reduce_for_bwd_pass", "torch", TORCH,
            "wrapped with the collectives: a rank joined under Join (uneven inputs) shadows the others' all-reduces "
            "here, a wait like any other", "output/ddptiming.py", params=()),
    Private("torch.distributed._broadcast_coalesced", "torch", TORCH,
            "wrapped with the collectives: DDP's buffer broadcast at each forward (BatchNorm's statistics), a "
            "wait in a collective like any other", "output/collectives.py"),
    Private("torch._C._distributed_c10d.ProcessGroup._register_on_completion_hook", "torch", TORCH,
            "on CUDA, each NCCL collective's GPU time (TORCH_NCCL_ENABLE_TIMING) from NCCL's watchdog thread, "
            "without a host sync; on a rank where it does not register (gloo, an older NCCL) nothing is timed "
            "and the rank sends no collective time", "output/collectives.py"),
    Private("torch._dynamo", "torch", TORCH, "imported by a compiler factory (the session compiles), so its forks "
            "have it: what a new process pays before its first torch.compile", "rank/factory.py"),
    Private("torch._inductor.compile_fx", "torch", TORCH, "imported by a compiler factory, as torch._dynamo",
            "rank/factory.py"),
    Private("torch._inductor.cpu_vec_isa.pick_vec_isa", "torch", TORCH,
            "Inductor's probe of the CPU's vector instructions, taken once by a compiler factory: its forks inherit "
            "the answer (valid_vec_isa_list's cache) instead of building and loading test libraries each",
            "rank/factory.py", params=()),
    Private("torch._dynamo.eval_frame.OptimizedModule", "torch", TORCH,
            "torch.compile's wrapper comes back as its _orig_mod", "transfer/unwrap.py",
            attributes=("_orig_mod",), by_path=True),
    Private("torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel", "torch", TORCH,
            "comes back as its .module when whole in rank 0 (NO_SHARD or a world of one, use_orig_params=True)",
            "transfer/unwrap.py", attributes=("module", "_use_orig_params", "sharding_strategy", "world_size"),
            by_path=True, set_in=("torch.distributed.fsdp._init_utils",)),
    # -- torch: a sharded module made ordinary again in rank 0, once its DTensors are gathered (FSDP2, tensor parallel)
    Private("torch.nn.Module", "torch", TORCH,
            "its hook tables, by key: the hooks sharding attached (FSDP2's forward, state dict and load hooks, tensor "
            "parallel's) taken off a module that comes back whole, with their with-kwargs and always-called flags",
            "transfer/unshard.py",
            attributes=("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                        "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                        "_load_state_dict_post_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                        "_forward_hooks_always_called")),
    Private("torch.nn.modules.module._WrappedHook", "torch", TORCH,
            "a load_state_dict hook's wrapper: its .hook is the function we ask sharding attached or not",
            "transfer/unshard.py", attributes=("hook",)),
    Private("torch.distributed._composable.contract.generate_state_key", "torch", TORCH,
            "the prefix of the __dict__ keys where fully_shard keeps its state on a module: removed with it",
            "transfer/unshard.py", params=("string",), mentions=("__composable_api_state_key",)),
    Private("torch.distributed.fsdp._fully_shard._fully_shard", "torch", TORCH,
            "fully_shard sets these flags on every module it manages (for dynamo): removed with its state",
            "transfer/unshard.py", mentions=("_is_fsdp_managed_module", "_fsdp_use_orig_params")),
    # -- torch.distributed: nccl served by gloo on a host without GPUs (the functions are replaced on the module)
    Private("torch.distributed.distributed_c10d.init_process_group", "torch", TORCH,
            "replaced on torch.distributed and distributed_c10d: backend 'nccl' becomes 'gloo'", "rank/devices.py",
            params=("backend",)),
    Private("torch.distributed.distributed_c10d.new_group", "torch", TORCH,
            "replaced likewise; spares import distributed_c10d to warm (rank/spare.py)", "rank/devices.py",
            params=("backend",)),
    # -- torch.distributed: the other ranks held while one is at a pdb prompt (what torch.distributed.breakpoint does)
    Private("torch.distributed.distributed_c10d._pg_map", "torch", TORCH,
            "every process group of the rank, whose timeouts are raised while a rank is in pdb", "rank/cellpdb.py"),
    Private("torch.distributed.distributed_c10d._set_pg_timeout", "torch", TORCH,
            "raises a group's timeout while a rank is in pdb, and puts the cell's back after", "rank/cellpdb.py",
            params=("timeout", "group")),
    Private("torch.distributed.ProcessGroup", "torch", TORCH,
            "a group's device types and each one's backend, whose options hold the timeout to put back",
            "rank/cellpdb.py", attributes=("_get_backend", "_device_types")),
    Private("torch._C._distributed_c10d.Backend.Options", "torch", TORCH,
            "a backend's timeout now (gloo's and NCCL's options): put back once no rank is in pdb; "
            "without it the raised timeout stays", "rank/cellpdb.py", attributes=("_timeout",)),
    # -- torch.distributed: kept ranks' gloo group, whose communicator a failed cell abandons and the next renews
    Private("torch.distributed.ProcessGroup._register_backend", "torch", TORCH,
            "the first communicator registered as the Python group's CPU backend: what torch asks the group's backend "
            "(FSDP2: whether it allocates tensors)", "rank/abortable.py"),
    Private("torch.distributed.ProcessGroupGloo", "torch", TORCH,
            "the all-gather and reduce-scatter of one tensor keep their older names on the backend: each collective "
            "of the group is forwarded to the current communicator by the name it has there",
            "rank/abortable.py, rank/communicator.py",
            attributes=("_allgather_base", "_reduce_scatter_base", "alltoall_base", "allreduce", "broadcast")),
    Private("torch.distributed.fsdp.FSDPModule._get_fsdp_state", "torch", TORCH,
            "which FSDP2 modules are roots: their public reset_iter_state() is called after a failed kept cell",
            "rank/recovery.py"),
    Private("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState", "torch", TORCH,
            "its _is_root: True on the module fully_shard was applied to last (a root), once it ran",
            "rank/recovery.py", attributes=("_is_root",)),
    Private("torch.distributed.distributed_c10d._world", "torch", TORCH,
            "its group_count, which names each new group (the store prefix its rendezvous uses): a rank that replaced a "
            "dead kept one takes the survivors' count, so the next new_group has one name on every rank; its pg_map, "
            "whose default group's store (PrefixStore('{group_name}/', PrefixStore('default_pg', store)), as "
            "init_process_group makes it) a survivor of rank 0 points at the new rank 0's store",
            "rank/groups.py", attributes=("group_count", "pg_map")),
    # -- accelerate and the HF Trainer: the folder of their per-rank files, written in place (the [test] extra runs them)
    Private("accelerate.accelerator.save_accelerator_state", "accelerate", ACCELERATE,
            "replaced in accelerate.accelerator's namespace: Accelerator.save_state calls it with the folder where every "
            "rank writes its random_states_{i}.pkl, which is shared first", "writes/savers.py",
            params=("output_dir", "process_index")),
    Private("accelerate.accelerator.Accelerator.save_state", "accelerate", ACCELERATE,
            "calls save_accelerator_state by its name in the module (what we replace); without it rank 1's "
            "random_states_1.pkl stays in its private layer", "writes/savers.py", mentions=("save_accelerator_state",)),
    Private("transformers.trainer.Trainer._save_rng_state", "transformers", TRANSFORMERS,
            "wrapped: its output_dir (a checkpoint-N folder) is shared before every rank writes its rng_state_{i}.pth",
            "writes/savers.py", params=("output_dir",)),
    Private("transformers.trainer.Trainer._save_checkpoint", "transformers", TRANSFORMERS,
            "calls _save_rng_state for each checkpoint on every rank: where the wrapper is reached", "writes/savers.py",
            mentions=("_save_rng_state",)),
    # -- Ray (the [ray] extra)
    Private("ray._private.state.state.available_resources_per_node", "ray", RAY,
            "each node's free GPUs and CPUs, for %taas status and placement", "launch/ray/attachment.py"),
)
