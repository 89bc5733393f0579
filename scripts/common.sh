# Shared by scripts/test.sh and scripts/validate-deploy.sh (sourced, run from the repository root).

log() { printf '\n== %s\n' "$*"; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  log "installing $* with apt-get"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

# The Python venv the tests use: the official `openai` SDK for the end-to-end SDK test,
# schemathesis to fuzz the management API from its OpenAPI document, and for
# the deployment checks helm-python-sdk (Helm's engine as a library: lint, template) and
# kubernetes-validate (Kubernetes' schemas). Installed once; everything after that runs offline.
VENV=.venv
PYTHON_PACKAGES=(openai helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 schemathesis==4.32.5)
ensure_venv() {
  if ! "$VENV/bin/python" -c "import openai, helm_python, kubernetes_validate, schemathesis" 2>/dev/null; then
    log "installing ${PYTHON_PACKAGES[*]} into $VENV"
    if [ ! -x "$VENV/bin/python" ]; then
      python3 -m venv "$VENV" 2>/dev/null || { apt_install python3-venv; rm -rf "$VENV"; python3 -m venv "$VENV"; }
    fi
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "${PYTHON_PACKAGES[@]}"
  fi
}
