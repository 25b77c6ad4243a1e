"""The `k3export` command line. Each stage is a subcommand that reads and writes artifacts on disk."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="k3export")
def main() -> None:
    """k3export: compile the Kimi K3 hybrid LLM (KDA + Gated MLA + LatentMoE + Block AttnRes) for deployment.

    Pipeline: init/load a checkpoint -> export prefill and decode graphs -> kernels -> engines -> run/bench.
    Every command says what it wrote and where."""


def _register() -> None:
    """Attach each stage's commands (one import line per stage module)."""
    from k3export.bench import bench
    from k3export.calibrate import calibrate_command
    from k3export.commands import demo, generate, init
    from k3export.export import export_cmd
    from k3export.onnx_export import onnx_cmd
    from k3export.verify import verify_cmd
    from k3export.shapes import shapes
    from k3export.build import build_command
    from k3export.runtime import run_command
    for cmd in (init, shapes, generate, demo, bench, calibrate_command, build_command, run_command,
                export_cmd, onnx_cmd, verify_cmd):
        main.add_command(cmd)


_register()

if __name__ == "__main__":
    main()
