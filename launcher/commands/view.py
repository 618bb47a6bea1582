"""`pdecomp view <run_dir>`: the local web viewer of an analysed run's components
(pdecomp.analysis.view)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from launcher.commands.common import Parser, refuse
from pdecomp.analysis.view import serve


def parser() -> Parser:
    p = Parser(prog="pdecomp view",
               description="Serve a local web viewer of an analysed run's components "
                           "(`pdecomp analyze` first): pages, sorts and searches each site.")
    p.add_argument("run_dir", help="a run directory analysed by `pdecomp analyze`")
    p.add_argument("--port", type=int, default=8765, help="0: any free port (default 8765)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    return p


def main(argv: Sequence[str], ready: threading.Event | None = None) -> int:
    args = parser().parse_args(argv)
    run_dir = Path(args.run_dir).absolute()
    found = list((run_dir / "analysis" / "components").glob("*.parquet"))
    if not found:
        return refuse("pdecomp view", f"{run_dir}: no analysis/components/*.parquet (run "
                      "`pdecomp analyze` on it first)")
    if not 0 <= args.port < 65536:
        return refuse("pdecomp view", f"--port={args.port} must be in 0..65535")
    try:
        server = serve(run_dir, args.host, args.port)
    except OSError as e:  # a port in use or refused, a host that does not resolve
        why = e.strerror or str(e)
        return refuse("pdecomp view", f"--host={args.host} --port={args.port}: cannot listen "
                      f"there ({why}); give a free port (0: any) or a local address")
    print(f"http://{args.host}:{server.server_address[1]}/", flush=True)
    if ready:
        ready.set()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
