"""`new-env`: a new verifiers v1 environment package that installs and trains as written.

`render.py` fills the templates (`templates/<kind>/*.tmpl`, package data) into the package's files;
`workspace.py` makes a package written inside a uv workspace a member the root pyproject.toml lists.
Called by `entrypoints/new_env.py`; imports nothing else of prime_async.
"""
