#!/bin/sh
# `pip install "$@"` inside an image build, with the build's optional BuildKit secrets:
#   /run/secrets/ca       a CA bundle (PIP_CERT) for a package index behind a TLS-inspecting proxy
#   /run/secrets/pipconf  a pip.conf (PIP_CONFIG_FILE): index URLs, credentials, a wheelhouse
# Secrets are mounted for this RUN only; nothing of them stays in the image.
set -eu
if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi
if [ -s /run/secrets/pipconf ]; then export PIP_CONFIG_FILE=/run/secrets/pipconf; fi
exec pip install "$@"
