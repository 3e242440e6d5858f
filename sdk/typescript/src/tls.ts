/**
 * The channel credentials of a client: plaintext, or TLS for a `kiln serve --tls-cert ... --tls-key ...`
 * (the Python SDK's kiln/client/channel.py). `tls: true` trusts the system's roots; `{ ca }` trusts that
 * CA instead (a private or self-signed one); `cert` + `key` present a client certificate, for a server
 * started with --tls-client-ca. The server's certificate must name the host of the address (a DNS name or
 * an IP address in its subjectAltName). PEM that cannot be parsed, a certificate without its key, or a key
 * that is not the certificate's own is an InvalidArgumentError when the client is created, not an
 * UNAVAILABLE on its first call.
 */
import { X509Certificate } from "node:crypto";

import * as grpc from "@grpc/grpc-js";

import { InvalidArgumentError } from "./errors.js";

/** PEM text, or its bytes. */
export type Pem = string | Buffer;

/** TLS settings of a client (see ClientOptions.tls). */
export interface TlsOptions {
  /** CA certificate(s) to trust instead of the system's roots. */
  ca?: Pem;
  /** The client's certificate chain, for a server that requires client certificates; needs `key`. */
  cert?: Pem;
  /** The private key of `cert` (unencrypted). */
  key?: Pem;
}

/** Credentials for `tls` as ClientOptions takes it: undefined or false is plaintext. */
export function channelCredentials(tls: boolean | TlsOptions | undefined): grpc.ChannelCredentials {
  if (tls === undefined || tls === false) return grpc.credentials.createInsecure();
  if (tls === true) return secure(null, null, null);
  if (typeof tls !== "object" || tls === null || Array.isArray(tls)) {
    throw new InvalidArgumentError("tls must be true, false or { ca?, cert?, key? }");
  }
  const [ca, cert, key] = [certificate("tls.ca", tls.ca), certificate("tls.cert", tls.cert), pem("tls.key", tls.key)];
  if ((cert === null) !== (key === null)) {
    const [given, missing] = cert === null ? ["tls.key", "tls.cert"] : ["tls.cert", "tls.key"];
    throw new InvalidArgumentError(`${given} needs ${missing} (a client certificate and its private key)`);
  }
  return secure(ca, key, cert);
}

/** PEM that must hold a certificate: Node would ignore a CA that is not one, and then trust nothing. */
function certificate(name: string, value: unknown): Buffer | null {
  const bytes = pem(name, value);
  if (bytes === null) return null;
  try {
    new X509Certificate(bytes);
  } catch {
    throw new InvalidArgumentError(`${name} holds no PEM certificate`);
  }
  return bytes;
}

function pem(name: string, value: unknown): Buffer | null {
  if (value === undefined) return null;
  if (typeof value === "string") return Buffer.from(value, "utf8");
  if (Buffer.isBuffer(value)) return value;
  throw new InvalidArgumentError(`${name} must be PEM text (a string or a Buffer)`);
}

/** grpc-js parses the PEM here (Node's tls.createSecureContext): its error becomes InvalidArgumentError. */
function secure(ca: Buffer | null, key: Buffer | null, cert: Buffer | null): grpc.ChannelCredentials {
  try {
    return grpc.credentials.createSsl(ca, key, cert);
  } catch (error) {
    throw new InvalidArgumentError(`tls: cannot use the given PEM: ${(error as Error).message}`, { cause: error });
  }
}
