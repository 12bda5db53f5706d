#!/usr/bin/env bash
# Makes throwaway TLS material for the tests, with the openssl CLI, in DIR:
#   ca.pem / ca.key          a test CA
#   server.pem / server.key  for 127.0.0.1 and localhost, signed by the CA
#   client.pem / client.key  a client certificate (mutual TLS), signed by the CA
# Used by tests/tls_ingest.rs and python/tests/test_tls.py.
set -euo pipefail
dir="${1:?usage: make-test-certs.sh DIR}"
cd "$dir"
ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 "${ec[@]}" -keyout ca.key -out ca.pem -days 1 -subj "/CN=stepwatch test CA" 2>/dev/null
sign() { # name subject extensions
  openssl req "${ec[@]}" -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%b' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial \
    -out "$1.pem" -days 1 -extfile "$1.ext" 2>/dev/null
}
sign server localhost 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n'
sign client stepwatch-test-client 'extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n'
