#!/usr/bin/env bash
# Provides the webhook's TLS certificate without cert-manager:
#   1. a CA (created once, then reused from DIR so that renewals keep caBundle unchanged),
#   2. a serving certificate for gpufrac-webhook.gpufrac-system.svc signed by it,
#   3. the Secret gpufrac-webhook-tls (tls.crt, tls.key) in gpufrac-system,
#   4. the CA as caBundle of the MutatingWebhookConfiguration gpufrac-webhook, and of the
#      ValidatingWebhookConfiguration gpufrac-dra-config when it is installed
#      (dra/config-validation.yaml),
#   5. a restart of the webhook's pods if they already run, so they serve the new one.
#
# Usage (after `kubectl apply -f webhook.yaml`, with kubectl pointed at the cluster):
#   examples/kubernetes/make-webhook-cert.sh [DIR]
# DIR (default ./gpufrac-webhook-certs) keeps ca.key: keep it private, or delete it and
# run again to start from a new CA. Run again before the certificate expires (DAYS, 365 by
# default) to renew it. Needs openssl and kubectl.
#
# The alternative is cert-manager: see the comments in webhook.yaml.
set -euo pipefail

NAMESPACE=${NAMESPACE:-gpufrac-system}
SERVICE=${SERVICE:-gpufrac-webhook}
SECRET=${SECRET:-gpufrac-webhook-tls}
WEBHOOK_CONFIG=${WEBHOOK_CONFIG:-gpufrac-webhook}
VALIDATING_CONFIG=${VALIDATING_CONFIG:-gpufrac-dra-config}
DAYS=${DAYS:-365}
DIR=${1:-./gpufrac-webhook-certs}

for tool in openssl kubectl; do
    command -v "$tool" >/dev/null || { echo "make-webhook-cert.sh: $tool is needed" >&2; exit 1; }
done
mkdir -p "$DIR"
chmod 700 "$DIR"
cd "$DIR"

# openssl's chatter (key generation progress) is shown only when it fails.
quiet() {
    "$@" 2>openssl.log || { cat openssl.log >&2; exit 1; }
}

if [[ ! -s ca.key || ! -s ca.crt ]]; then
    echo "creating a CA in $PWD"
    quiet openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 \
        -keyout ca.key -out ca.crt -subj "/CN=gpufrac-webhook-ca"
fi

host="$SERVICE.$NAMESPACE.svc"
cat > server.ext <<EXT
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = DNS:$host, DNS:$host.cluster.local, DNS:$SERVICE.$NAMESPACE
EXT
quiet openssl req -newkey rsa:2048 -nodes -sha256 -keyout tls.key -out tls.csr -subj "/CN=$host"
quiet openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 \
    -days "$DAYS" -extfile server.ext -out tls.crt
quiet openssl verify -CAfile ca.crt tls.crt >/dev/null
echo "signed a certificate for $host, valid $DAYS days"

kubectl -n "$NAMESPACE" create secret tls "$SECRET" --cert=tls.crt --key=tls.key \
    --dry-run=client -o yaml | kubectl apply -f -

ca_bundle=$(base64 < ca.crt | tr -d '\n')
kubectl patch mutatingwebhookconfiguration "$WEBHOOK_CONFIG" --type=json \
    -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$ca_bundle\"}]"
# The DRA claims' check, served by the same pods (only on clusters that installed it).
if kubectl get validatingwebhookconfiguration "$VALIDATING_CONFIG" >/dev/null 2>&1; then
    kubectl patch validatingwebhookconfiguration "$VALIDATING_CONFIG" --type=json \
        -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$ca_bundle\"}]"
fi

# Pods read the certificate when they start.
if kubectl -n "$NAMESPACE" get deployment "$SERVICE" >/dev/null 2>&1; then
    kubectl -n "$NAMESPACE" rollout restart deployment "$SERVICE"
fi
echo "done: the webhook serves $host with a certificate from $PWD/ca.crt"
