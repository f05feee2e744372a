"""Distributed serving on Ray: router deployment, worker actors, fleet controller, OpenAI API.

The only package that imports ray. Entry points: `raypaged.serve.app:build_app` (a Serve
application builder) and `raypaged serve` (raypaged/serve/cli.py).
"""
