"""`python -m servelab.cli`: the same command as `servelab` (`servelab up` starts the api this way).

Knows only where the app is.
"""

from servelab.cli import app

app()
