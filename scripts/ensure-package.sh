#!/bin/sh
# Make sure a command from a Debian package is installed: usage ensure-package.sh COMMAND PACKAGE.
# Installs it with apt-get when we are root (or have passwordless sudo); otherwise says what to run.
set -eu
cmd=$1 pkg=$2
command -v "$cmd" >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ]; then
	as_root=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
	as_root="sudo -n"
else
	echo "$cmd is not installed and installing needs root: run 'sudo apt-get install $pkg'" >&2
	exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
	echo "$cmd is not installed and this is not a Debian system: install $pkg yourself" >&2
	exit 1
fi
echo "installing $pkg (Debian package) for $cmd ..." >&2
$as_root apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq "$pkg" >/dev/null
command -v "$cmd" >/dev/null 2>&1 || { echo "installing $pkg did not provide $cmd" >&2; exit 1; }
