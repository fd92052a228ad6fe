#!/usr/bin/env bash
# make_rig_certs DIR: a certificate authority made for this run and everything the TLS
# tests need from it, as PEM files in DIR (keys unencrypted PKCS#8):
#   ca.crt ca.key             the rig's CA
#   server.crt server.key     a server certificate for the name localhost (not
#                             127.0.0.1): verify-full through localhost passes, through
#                             127.0.0.1 it must fail; and for the address relay pods on
#                             the rig's node reach the servers at (POD_GATEWAY)
#   server.pem                server.key then server.crt (Kafka's PEM keystore)
#   client.crt client.key     a client certificate, CN=outbox_cert (the PostgreSQL
#                             role, RabbitMQ user and Kafka principal of mTLS tests)
#   expired.crt expired.key   a server certificate for localhost that expired in 2020
#   other-ca.crt              a CA nobody's certificate chains to (the "wrong CA")
make_rig_certs() {
  local dir=$1
  mkdir -p "$dir"
  (
    cd "$dir"
    ca() { # ca NAME CN
      openssl req -x509 -newkey rsa:2048 -nodes -days 3 -subj "/CN=$2" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -keyout "$1.key" -out "$1.crt"
    }
    ca ca outbox-rig-ca
    ca other-ca outbox-rig-other-ca
    rm -f other-ca.key
    printf 'subjectAltName=DNS:localhost,IP:%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$POD_GATEWAY" >server.ext
    printf 'extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n' >client.ext
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
    openssl x509 -req -days 3 -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
      -extfile server.ext -out server.crt
    cat server.key server.crt >server.pem
    openssl req -newkey rsa:2048 -nodes -subj "/CN=outbox_cert" -keyout client.key -out client.csr
    openssl x509 -req -days 3 -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
      -extfile client.ext -out client.crt
    # `openssl x509` cannot back-date; `openssl ca` can, from a throwaway database.
    mkdir -p expired-ca
    : >expired-ca/index.txt
    cat >expired-ca/ca.conf <<EOC
[ca]
default_ca = rig
[rig]
database = $dir/expired-ca/index.txt
new_certs_dir = $dir/expired-ca
serial = $dir/expired-ca/serial
default_md = sha256
policy = any
copy_extensions = none
[any]
commonName = supplied
EOC
    echo 01 >expired-ca/serial
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout expired.key -out expired.csr
    openssl ca -batch -config expired-ca/ca.conf -cert ca.crt -keyfile ca.key \
      -startdate 20200101000000Z -enddate 20200102000000Z -extfile server.ext \
      -in expired.csr -out expired.crt -notext
    rm -f ./*.csr ./*.ext ./*.srl
    chmod 644 ./*.crt
    chmod 600 ./*.key server.pem
  ) >"$dir/openssl.log" 2>&1 || { cat "$dir/openssl.log" >&2; return 1; }
}
