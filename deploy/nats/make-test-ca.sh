#!/bin/sh
# A throw-away CA, a server certificate and one client certificate per genmesh role, for
# mesh-tls.conf and the TLS tests. Not for production: use your own PKI there.
#
#   deploy/nats/make-test-ca.sh [DIR] [EXTRA_SAN ...]     (DIR defaults to deploy/nats/certs)
#
# DIR/ca.pem, DIR/server-cert.pem, DIR/server-key.pem, DIR/<role>-cert.pem and
# DIR/<role>-key.pem for frontend, router, worker, client, admin. The server certificate is
# valid for localhost, 127.0.0.1, ::1, nats, nats-1, nats-2, nats-3 and any EXTRA_SAN
# (e.g. DNS:mesh.example.com, IP:10.0.0.5). EC P-256 keys, valid for 825 days.
set -eu

dir=${1:-$(dirname "$0")/certs}
[ $# -gt 0 ] && shift
mkdir -p "$dir"
cd "$dir"
umask 077

sans="DNS:localhost,IP:127.0.0.1,IP:::1,DNS:nats,DNS:nats-1,DNS:nats-2,DNS:nats-3"
for extra in "$@"; do sans="$sans,$extra"; done

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# The CA.
key ca-key.pem
openssl req -x509 -new -key ca-key.pem -sha256 -days 825 -subj "/O=genmesh test/CN=genmesh test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.pem

# sign NAME SUBJECT EXTENSIONS
sign() {
    key "$1-key.pem"
    openssl req -new -key "$1-key.pem" -subj "$2" -out "$1.csr"
    printf '%s\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -sha256 \
        -days 825 -extfile "$1.ext" -out "$1-cert.pem" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
}

sign server "/O=genmesh test/CN=nats" \
    "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$sans"

for role in frontend router worker client admin; do
    sign "$role" "/O=genmesh test/CN=$role" \
        "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
done

rm -f ca.srl
# Certificates are public; keys stay private to the owner, but must be readable by the
# container users that mount them (compose): loosen with chmod where needed.
chmod 644 ca.pem ./*-cert.pem
echo "test CA and certificates in $(pwd)"
