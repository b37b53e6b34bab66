// Every message's examples, validated against its payload and headers schemas as @asyncapi/parser
// dereferenced them (its v3 ruleset does not check examples itself). Exit 1 with each failure.
import { Parser } from '@asyncapi/parser';
import Ajv from 'ajv';
import fs from 'fs';
const { document, diagnostics } = await new Parser().parse(fs.readFileSync(process.argv[2], 'utf8'));
if (!document) { console.error(`INVALID: ${diagnostics.filter(d => d.severity === 0).length} errors`); process.exit(1); }
const ajv = new Ajv({ strict: false, allErrors: true, validateFormats: false });
let checked = 0, failed = 0;
for (const message of document.messages()) {
  const examples = message.examples().all();
  if (examples.length === 0) { console.error(`NO EXAMPLE: ${message.id()}`); failed++; }
  for (const ex of examples) {
    for (const [part, schema, value] of [['payload', message.payload(), ex.payload()], ['headers', message.headers(), ex.headers()]]) {
      if (value === undefined || !schema) continue;
      const validate = ajv.compile(schema.json());
      checked++;
      if (!validate(value)) { failed++; console.error(`EXAMPLE INVALID: ${message.id()} ${part}: ${ajv.errorsText(validate.errors)}`); }
    }
  }
}
if (failed) { console.error(`INVALID: ${failed} example failures`); process.exit(1); }
console.log(`EXAMPLES VALID: ${checked} checks over ${document.messages().length} messages`);
