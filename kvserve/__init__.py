"""kvserve: an OpenAI-compatible LLM serving daemon.

The one name kvserve installs. The design's folders at the top of the checkout
(server/, engine/, scheduler/, kvcache/, modelstore/) are its sub-packages:
kvserve.server, kvserve.engine, kvserve.scheduler, kvserve.kvcache and
kvserve.modelstore. A wheel puts them inside this folder (pyproject.toml maps each
one), so nothing named `server` or `engine` lands in site-packages beside other
people's packages. What lives in this folder itself belongs to no layer: the
`kvserve bench` tools (benchmarks/).
"""
from pathlib import Path as _Path

# In a checkout the sub-packages sit beside this folder, not in it: look there too,
# so the tree runs as it is (PYTHONPATH=., as on the bare GPU machine) as well as
# installed, editable or not.
_checkout = _Path(__file__).resolve().parent.parent
_installed = (_Path(__file__).parent / "engine").is_dir()
if not _installed and (_checkout / "engine" / "__init__.py").is_file():
    __path__.append(str(_checkout))
