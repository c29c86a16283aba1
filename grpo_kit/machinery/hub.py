"""Uploading a verified export to the Hugging Face Hub, with a token that is never printed or written."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_kit.errors import GrpoKitError


def hub_token() -> str | None:
    """``$HF_TOKEN``, else (inside Colab only) the Colab secret ``HF_TOKEN``, else None. Never printed."""
    token = os.environ.get("HF_TOKEN")
    if token:
        return token
    from grpo_kit.machinery.runtime import in_colab

    if in_colab():
        try:
            from google.colab import userdata  # type: ignore[import-not-found]

            return userdata.get("HF_TOKEN")
        except Exception:  # secret missing or access not granted
            return None
    return None


def upload_folder(folder: Path, repo: str, token: str) -> str:
    """Create ``repo`` if needed and upload ``folder`` to it; returns the repo URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo, exist_ok=True)
    api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message="grpo-kit export")
    return f"https://huggingface.co/{repo}"


def push_folder(folder: Path, repo: str) -> str:
    """Upload ``folder`` with ``hub_token()``; errors are re-raised with the token scrubbed from the message."""
    token = hub_token()
    if not token:
        raise GrpoKitError(
            f"No Hugging Face token for pushing to {repo}. Set HF_TOKEN in the environment (a write token from "
            "https://huggingface.co/settings/tokens), or in Colab add it as the secret 'HF_TOKEN'. The export itself "
            f"is complete in {folder}."
        )
    try:
        return upload_folder(folder, repo, token)
    except Exception as error:  # network, permissions, bad repo id: say what and keep the token out of it
        message = str(error).replace(token, "***")
        raise GrpoKitError(
            f"Upload of {folder} to {repo} failed: {type(error).__name__}: {message}. The export itself is complete "
            f"and verified on disk in {folder}; retry the upload with `huggingface-cli upload {repo} {folder}`."
        ) from None
