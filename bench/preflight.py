"""What a GPU machine has, one line each: Python, torch and its CUDA, the device, and every module kvtool's
GPU check imports (version, or MISSING and why). ``scripts/gpu-check.sh`` runs it first, so a lease spent on a
machine without transformers or bitsandbytes says so in its first second.

    python bench/preflight.py [--json OUT.json]

Exit code 0 when every module kvtool needs imports (bitsandbytes is optional: its steps are skipped), else 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.jsonfile import write_json  # noqa: E402

#: kvtool's own dependencies (pyproject.toml) and the test runner the check uses
REQUIRED = ("torch", "transformers", "accelerate", "safetensors", "typer", "rich", "yaml", "psutil", "numpy",
            "tokenizers", "pytest")
#: used where present: bitsandbytes for the 4/8-bit steps, gguf for .gguf checkpoints
OPTIONAL = ("bitsandbytes", "gguf")


def module_line(name: str) -> tuple[str, str | None]:
    """(one line for the log, the version or None when it does not import)."""
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # a broken CUDA build raises more than ImportError
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        return f"MISSING {name}: {type(exc).__name__}: {first}", None
    version = str(getattr(mod, "__version__", "?"))
    return f"ok      {name} {version}", version


def cuda_runtime_bytes() -> int:
    """GPU memory this process holds outside torch's allocator once it has run a bf16 product: the CUDA
    context, loaded kernels, cuBLAS's handle and workspace (total − free − what the allocator reserved)."""
    import torch

    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    free, total = torch.cuda.mem_get_info(0)
    return int(total - free - torch.cuda.memory_reserved(0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    doc: dict = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                 "modules": {}, "missing": []}
    print(f"ok      python {doc['python']} ({sys.executable}), {doc['cpus']} CPUs")
    for name in REQUIRED + OPTIONAL:
        line, version = module_line(name)
        print(line if name in REQUIRED or version else line.replace("MISSING", "absent ", 1), flush=True)
        doc["modules"][name] = version
        if version is None and name in REQUIRED:
            doc["missing"].append(name)
    if doc["modules"].get("torch"):
        import torch

        doc["cuda_available"] = torch.cuda.is_available()
        doc["torch_cuda"] = torch.version.cuda
        if doc["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info(0)
            doc.update(device=props.name, capability=f"{props.major}.{props.minor}",
                       multiprocessors=props.multi_processor_count, memory_bytes=total, free_bytes=free,
                       bf16=torch.cuda.is_bf16_supported())
            print(f"ok      cuda {torch.version.cuda}: {props.name}, sm_{props.major}{props.minor}, "
                  f"{props.multi_processor_count} SMs, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free)")
            doc["cuda_runtime_bytes"] = runtime = cuda_runtime_bytes()
            print(f"ok      the CUDA runtime holds {runtime / 2**20:.0f} MiB outside torch's allocator (context, "
                  "kernels, cuBLAS workspace after one bf16 product; kvtool's plan allows "
                  "runtime/memory.CUDA_RUNTIME_BYTES)")
        else:
            print(f"absent  cuda: torch {torch.__version__} sees no CUDA device (torch.version.cuda "
                  f"{torch.version.cuda})")
    tmp = tempfile.gettempdir()
    doc["tmp_free_bytes"] = shutil.disk_usage(tmp).free
    print(f"ok      {tmp}: {doc['tmp_free_bytes'] / 2**30:.1f} GiB free (the recall archive of the ask rows)")
    if args.json_path:
        write_json(args.json_path, doc)
    if doc["missing"]:
        print(f"MISSING required: {', '.join(doc['missing'])}")
    return 1 if doc["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
