"""Distributed serving on Ray: router deployment, worker actors, fleet controller, OpenAI API.

With raypaged.batch (which runs these workers without HTTP), the only packages that import
ray. Entry points: `raypaged.serve.app:build_app` (a Serve
application builder) and `raypaged serve` (raypaged/serve/cli.py).
"""
