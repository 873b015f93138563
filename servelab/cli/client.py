"""The API's client for batch files: `submit` uploads one and follows it, `results` downloads its output.

Knows the API's batch and file endpoints, the key and URL from ServiceSettings, and the JSONL batch format.
Does not know the queue, the store or the engine: everything goes through HTTP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from servelab.cli.options import fail, service_settings

ApiUrlOption = Annotated[str | None, typer.Option(help="default: SERVELAB_API_URL")]
ApiKeyOption = Annotated[str | None, typer.Option(help="default: SERVELAB_API_KEY")]


def _api_client(api_url: str | None, api_key: str | None):
    import httpx

    settings = service_settings()
    key = api_key or settings.api_key
    if not key:
        fail("no API key: pass --api-key or set SERVELAB_API_KEY (make one with `servelab keys create`)")
    return httpx.Client(base_url=(api_url or settings.api_url).rstrip("/"), timeout=120,
                        headers={"Authorization": f"Bearer {key}"})


def _checked(response) -> dict:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        fail(f"{response.request.method} {response.request.url.path}: {response.status_code}: {message}")
    return response.json()


def _content(response) -> bytes:
    """A file's bytes; an error response fails the command (its body is never written as the file)."""
    if response.status_code >= 400:
        _checked(response)
    return response.content


def _with_model(path: Path, config: str | None) -> tuple[bytes, str, int]:
    """The file with every parseable line's body.model set to config -> (content, endpoint, number of lines)."""
    out, endpoint, num_lines = [], None, 0
    with path.open("rb") as lines:
        for raw in lines:
            if not raw.strip():
                continue
            num_lines += 1
            try:
                record = json.loads(raw)
                endpoint = endpoint or record.get("url")
                if config and isinstance(record.get("body"), dict):
                    record["body"]["model"] = config
                    raw = json.dumps(record).encode() + b"\n"
            except (ValueError, AttributeError):
                pass  # NOTE: sent as it is: the server refuses it with a reason in the error file
            out.append(raw if raw.endswith(b"\n") else raw + b"\n")
    return b"".join(out), endpoint or "/v1/chat/completions", num_lines


def submit(
    file: Annotated[Path, typer.Argument(help="a JSONL batch file (OpenAI batch format)")],
    config: Annotated[str | None, typer.Option("--config", "-c", help="serving config name for every line")] = None,
    window: Annotated[str, typer.Option(help="completion window, e.g. 24h")] = "24h",
    no_wait: Annotated[bool, typer.Option("--no-wait", help="print the batch id and return at once")] = False,
    api_url: ApiUrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Upload a batch file, create the batch, and show its progress until it ends."""
    if not file.is_file():
        fail(f"{file}: no such file")
    content, endpoint, num_lines = _with_model(file, config)
    with _api_client(api_url, api_key) as client:
        uploaded = _checked(client.post("/v1/files", data={"purpose": "batch"},
                                        files={"file": (file.name, content, "application/jsonl")}))
        batch = _checked(client.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": endpoint,
                                                          "completion_window": window}))
        typer.echo(batch["id"])
        if no_wait:
            return
        batch = _follow(client, batch, num_lines)
    counts = batch["request_counts"]
    typer.echo(f"{batch['status']}: {counts['completed']} completed, {counts['failed']} failed of {counts['total']}")
    if batch["status"] != "completed":
        raise typer.Exit(code=1)


def _follow(client, batch: dict, num_lines: int) -> dict:
    """Poll the batch every second, with a progress bar over its lines (on a terminal's stderr), until it ends;
    the last state."""
    import time

    from servelab.cli.progress import progress_bar

    with progress_bar(length=num_lines, label=batch["id"]) as bar:
        done = 0
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(1.0)
            batch = _checked(client.get(f"/v1/batches/{batch['id']}"))
            counts = batch["request_counts"]
            bar.update(counts["completed"] + counts["failed"] - done)
            done = counts["completed"] + counts["failed"]
    return batch


def results(
    batch_id: Annotated[str, typer.Argument(help="batch_...")],
    output: Annotated[Path, typer.Option("--output", "-o", help="where the output JSONL goes")] = Path("out.jsonl"),
    errors: Annotated[Path | None, typer.Option(help="where the error JSONL goes (default: not written)")] = None,
    api_url: ApiUrlOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Download a batch's output file (and error file)."""
    with _api_client(api_url, api_key) as client:
        batch = _checked(client.get(f"/v1/batches/{batch_id}"))
        if batch["status"] not in ("completed", "expired", "cancelled"):
            fail(f"batch {batch_id} is {batch['status']}: no files yet")
        for file_id, path in ((batch["output_file_id"], output), (batch["error_file_id"], errors)):
            if path is None:
                continue
            content = b"" if file_id is None else _content(client.get(f"/v1/files/{file_id}/content"))
            path.write_bytes(content)
            typer.echo(f"{path}: {len(content.splitlines())} lines")
